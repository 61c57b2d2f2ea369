//! Raising the open-file limit for programs with many rdma_cm connections.

/// Raises the soft limit on open files to the hard limit: each rdma_cm id owns
/// an event channel (a descriptor; its readiness handle under tokio is another),
/// and the usual soft limit of 1024 runs out at a few hundred connections
/// (librdmacm then reports ENODEV from `rdma_get_devices`).
pub fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the valid struct `lim` only.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

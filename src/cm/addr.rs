//! Socket addresses in C form, waiting on a descriptor, and pinning librdmacm's device list.

use super::*;

/// Waits until `fd` is readable or `timeout` passes; the caller's loop
/// checks its event and its deadline again either way.
pub(super) fn poll_readable(fd: RawFd, timeout: Duration) -> Result<()> {
    let deadline = crate::sys::fd::deadline_after(timeout);
    match crate::sys::fd::poll_readable(fd, Some(deadline)) {
        Ok(_) => Ok(()),
        Err(source) => Err(Error::Io {
            what: "polling the rdma_cm event channel",
            source,
        }),
    }
}

pub(super) fn ms(timeout: Duration) -> i32 {
    i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX)
}

/// A socket address in C form.
pub(super) struct RawAddr {
    storage: libc::sockaddr_storage,
}

impl RawAddr {
    pub(super) fn new(addr: SocketAddr) -> RawAddr {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match addr {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
                unsafe {
                    std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin)
                };
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: a.flowinfo().to_be(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                // SAFETY: as above, for sockaddr_in6.
                unsafe {
                    std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6)
                };
            }
        }
        RawAddr { storage }
    }

    pub(super) fn as_ptr(&mut self) -> *mut ffi::sockaddr {
        (&mut self.storage as *mut libc::sockaddr_storage).cast()
    }
}

/// Reads a C socket address (IPv4/IPv6; anything else, or unset, is `None`).
///
/// # Safety
/// `p` is null or points to a sockaddr of its family's full size.
pub(super) unsafe fn read_addr(p: *const ffi::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: p points to at least a sockaddr header (caller).
    let family = i32::from(unsafe { (*p).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a full sockaddr_in (caller).
            let sin = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a full sockaddr_in6 (caller).
            let sin6 = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// librdmacm's device list, held to keep its device contexts open.
pub(super) struct DeviceListPin {
    list: NonNull<*mut ffi::ibv_context>,
}

// SAFETY: the pin only owns the list allocation; rdma_free_devices takes
// librdmacm's global lock and may run on any thread.
unsafe impl Send for DeviceListPin {}
// SAFETY: nothing is reachable through &DeviceListPin.
unsafe impl Sync for DeviceListPin {}

impl Drop for DeviceListPin {
    fn drop(&mut self) {
        // SAFETY: list came from rdma_get_devices and is freed once, here.
        unsafe { ffi::rdma_free_devices(self.list.as_ptr()) };
    }
}

impl DeviceListPin {
    /// Pins every device librdmacm knows (`rdma_get_devices` raises each
    /// device's reference count, so librdmacm does not close its context even
    /// if the device goes away) and checks that `verbs` is among them.
    pub(super) fn new(verbs: *mut ffi::ibv_context) -> Result<DeviceListPin> {
        let mut n = 0;
        // SAFETY: out-pointer for the count.
        let list = unsafe { ffi::rdma_get_devices(&mut n) };
        let list = NonNull::new(list).ok_or_else(|| {
            let e = last_errno();
            let hint = (e.raw_os_error() == Some(libc::ENODEV)).then(|| {
                "librdmacm reports ENODEV also when the process is out of file \
                 descriptors (each connection holds several): check `ulimit -n`"
                    .to_owned()
            });
            Error::Verb {
                verb: "rdma_get_devices",
                source: e,
                hint,
            }
        })?;
        let pin = DeviceListPin { list };
        let count = usize::try_from(n).unwrap_or(0);
        // SAFETY: the list holds `count` contexts followed by NULL.
        let found = (0..count).any(|i| unsafe { *list.as_ptr().add(i) } == verbs);
        if found {
            Ok(pin)
        } else {
            Err(Error::InvalidArgument {
                what: "rdma_cm id",
                reason: "its device is no longer in librdmacm's device list (removed?)".into(),
            })
        }
    }
}

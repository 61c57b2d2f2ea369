//! FLUSH (`ibv_wr_flush`), which rdma-core added in release 45, past the baseline (44) the
//! bindings come from, and which release of libibverbs this process loaded.
//!
//! `ibv_wr_flush` is no exported symbol: it is `static inline` over a function pointer,
//! `ibv_qp_ex::wr_flush`, which rdma-core 45 appended to `struct ibv_qp_ex` right after
//! `wr_atomic_write` (the last field of 44's). The provider allocates that struct inside its
//! own QP, so on a library older than 45 the bytes past 44's struct belong to the provider:
//! [`wr_flush`] reads the field only when [`libibverbs_release`] says the loaded library is
//! 45 or newer.

use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

use super::ibv_qp_ex;

/// `IBV_WR_FLUSH` of `enum ibv_wr_opcode` (rdma-core 45).
pub const IBV_WR_FLUSH: u32 = 14;
/// `IBV_WC_FLUSH` of `enum ibv_wc_opcode` (rdma-core 45).
pub const IBV_WC_FLUSH: u32 = 8;
/// `IBV_QP_EX_WITH_FLUSH` of `enum ibv_qp_create_send_ops_flags` (rdma-core 45).
pub const IBV_QP_EX_WITH_FLUSH: u64 = 1 << 11;
/// `IBV_ACCESS_FLUSH_GLOBAL` of `enum ibv_access_flags` (rdma-core 45).
pub const IBV_ACCESS_FLUSH_GLOBAL: u32 = 1 << 8;
/// `IBV_ACCESS_FLUSH_PERSISTENT` of `enum ibv_access_flags` (rdma-core 45).
pub const IBV_ACCESS_FLUSH_PERSISTENT: u32 = 1 << 9;
/// `IBV_FLUSH_GLOBAL` of `enum ibv_placement_type`.
pub const IBV_FLUSH_GLOBAL: u8 = 1 << 0;
/// `IBV_FLUSH_PERSISTENT` of `enum ibv_placement_type`.
pub const IBV_FLUSH_PERSISTENT: u8 = 1 << 1;
/// `IBV_FLUSH_RANGE` of `enum ibv_selectivity_level`.
pub const IBV_FLUSH_RANGE: u8 = 0;
/// `IBV_FLUSH_MR` of `enum ibv_selectivity_level`.
pub const IBV_FLUSH_MR: u8 = 1;
/// `IB_UVERBS_DEVICE_FLUSH_GLOBAL` of `device_cap_flags_ex` (Linux 6.2's uapi).
pub const IB_UVERBS_DEVICE_FLUSH_GLOBAL: u64 = 1 << 38;
/// `IB_UVERBS_DEVICE_FLUSH_PERSISTENT` of `device_cap_flags_ex` (Linux 6.2's uapi).
pub const IB_UVERBS_DEVICE_FLUSH_PERSISTENT: u64 = 1 << 39;

/// The first rdma-core release with `ibv_wr_flush`.
pub const FLUSH_SINCE: u32 = 45;

/// `ibv_qp_ex::wr_flush`: `(qp, rkey, remote_addr, len, type, level)`.
pub type WrFlush = unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, usize, u8, u8);

/// Where `wr_flush` sits in rdma-core 45's `ibv_qp_ex`: right after `wr_atomic_write`
/// (whichever headers the bindings came from, 44's without the field or a newer one's with
/// it).
const WR_FLUSH_OFFSET: usize = std::mem::offset_of!(ibv_qp_ex, wr_atomic_write)
    + std::mem::size_of::<Option<unsafe extern "C" fn()>>();

/// The `wr_flush` entry point of `qpx`, or `None` where the loaded libibverbs predates it
/// ([`has_wr_flush`]) or the provider did not set it (a QP created without
/// [`IBV_QP_EX_WITH_FLUSH`]).
///
/// # Safety
/// `qpx` is a live `ibv_qp_ex` of the loaded libibverbs' provider.
pub unsafe fn wr_flush(qpx: *mut ibv_qp_ex) -> Option<WrFlush> {
    if !has_wr_flush() {
        return None;
    }
    // SAFETY: the loaded libibverbs is rdma-core 45 or newer, whose providers embed the
    // `ibv_qp_ex` that has the field at this offset (a function pointer, aligned as the
    // fields before it); `qpx` is live (contract). The read is unaligned-safe anyway.
    unsafe {
        qpx.cast::<u8>()
            .add(WR_FLUSH_OFFSET)
            .cast::<Option<WrFlush>>()
            .read_unaligned()
    }
}

/// Whether the loaded libibverbs has `ibv_qp_ex::wr_flush` (rdma-core 45 or newer).
pub fn has_wr_flush() -> bool {
    libibverbs_release().is_some_and(|r| r >= FLUSH_SINCE)
}

/// Not looked at yet.
const UNASKED: u32 = 0;
/// Looked at, not identified.
const UNKNOWN: u32 = u32::MAX;

/// The rdma-core release of the libibverbs this process loaded, as far as it can be told:
/// the release in the name of its file (`libibverbs.so.1.<abi>.<release>.<patch>`, the
/// symlinks resolved), and at least 49 where it exports `ibv_wr_opcode_str` (added in 49),
/// whichever is higher (a file laid over another under the older name still tells by what
/// it exports). `None` where neither tells.
pub fn libibverbs_release() -> Option<u32> {
    static RELEASE: AtomicU32 = AtomicU32::new(UNASKED);
    let mut r = RELEASE.load(Ordering::Relaxed);
    if r == UNASKED {
        r = detect().unwrap_or(UNKNOWN);
        RELEASE.store(r, Ordering::Relaxed);
    }
    (r != UNKNOWN).then_some(r)
}

/// See [`libibverbs_release`].
fn detect() -> Option<u32> {
    let by_name = symbol(c"ibv_get_device_list").and_then(release_of_file);
    let by_symbol = symbol(c"ibv_wr_opcode_str").map(|_| 49);
    by_name.max(by_symbol)
}

/// The address of `name` among the loaded objects.
fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `name` is NUL-terminated; RTLD_DEFAULT searches the loaded objects.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// The release in the name of the file that holds `addr`.
fn release_of_file(addr: *mut c_void) -> Option<u32> {
    // SAFETY: all-zero is a valid Dl_info (null pointers).
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `addr` is a symbol's address; `info` is writable.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr filled dli_fname with a NUL-terminated path the loader keeps.
    let path = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = std::path::Path::new(std::ffi::OsStr::new(path.to_str().ok()?));
    let real = std::fs::canonicalize(path).ok()?;
    release_in_name(real.file_name()?.to_str()?)
}

/// `56` of `libibverbs.so.1.14.56.1`.
fn release_in_name(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("libibverbs.so.1.")?;
    rest.split('.').nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_release_from_the_file_name() {
        assert_eq!(release_in_name("libibverbs.so.1.14.56.1"), Some(56));
        assert_eq!(release_in_name("libibverbs.so.1.14.44.0"), Some(44));
        assert_eq!(release_in_name("libibverbs.so.1"), None);
        assert_eq!(release_in_name("librdmacm.so.1.3.56.1"), None);
    }

    #[test]
    fn wr_flush_sits_right_after_44s_last_field() {
        // 44's struct ends with wr_atomic_write: the field 45 appended starts where it ends.
        assert!(WR_FLUSH_OFFSET <= std::mem::size_of::<ibv_qp_ex>() + 8);
        assert_eq!(WR_FLUSH_OFFSET % std::mem::align_of::<usize>(), 0);
    }
}

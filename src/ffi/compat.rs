//! Verbs newer than the oldest supported rdma-core, resolved at run time.
//!
//! Linking them directly would give the binary a versioned reference
//! (`ibv_reg_dmabuf_mr@IBVERBS_1.12`, `_ibv_query_gid_ex@IBVERBS_1.11`) that the
//! dynamic loader refuses on an older libibverbs. Instead each is looked up once
//! with `dlsym(RTLD_DEFAULT, ...)` (libibverbs is loaded: the crate links it) and a
//! missing one is a [`MissingSymbol`] (which converts into `Error::Unsupported`). The two GID queries are `static inline`
//! in rdma-core's headers; these are the same one-line bodies, calling the
//! exported `_ibv_query_gid_*` with the entry size of the bindings.

use std::ffi::{CStr, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{ibv_context, ibv_gid_entry, ibv_mr, ibv_pd};

/// A verb the libibverbs loaded at run time does not export.
///
/// Converts into the crate's `Error::Unsupported` (with `?`), whose hint names
/// the symbol and the rdma-core release that added it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingSymbol {
    /// The verb as the API names it, e.g. `ibv_reg_dmabuf_mr`.
    pub verb: &'static str,
    /// The exported symbol that was looked up, e.g. `_ibv_query_gid_ex`.
    pub symbol: &'static CStr,
    /// The rdma-core release that added it, e.g. `rdma-core 34`.
    pub since: &'static str,
}

impl MissingSymbol {
    /// What to do about it: the symbol, where it came from, and "upgrade rdma-core".
    pub fn hint(&self) -> String {
        format!(
            "the libibverbs loaded at run time has no `{}` (added in {}); upgrade rdma-core",
            self.symbol.to_string_lossy(),
            self.since
        )
    }
}

/// Not looked up yet.
const UNRESOLVED: usize = 0;
/// Looked up and absent.
const MISSING: usize = 1;

/// One run-time resolved symbol.
struct Lazy {
    name: &'static CStr,
    addr: AtomicUsize,
}

impl Lazy {
    const fn new(name: &'static CStr) -> Self {
        Lazy {
            name,
            addr: AtomicUsize::new(UNRESOLVED),
        }
    }

    /// The symbol's address, or the [`MissingSymbol`] naming `verb` and the
    /// rdma-core release that introduced it.
    fn get(&self, verb: &'static str, since: &'static str) -> Result<*mut c_void, MissingSymbol> {
        let mut a = self.addr.load(Ordering::Acquire);
        if a == UNRESOLVED {
            // SAFETY: `name` is NUL-terminated; RTLD_DEFAULT searches the loaded objects.
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, self.name.as_ptr()) };
            a = if p.is_null() { MISSING } else { p as usize };
            self.addr.store(a, Ordering::Release);
        }
        if a == MISSING {
            return Err(MissingSymbol {
                verb,
                symbol: self.name,
                since,
            });
        }
        Ok(a as *mut c_void)
    }
}

static REG_DMABUF_MR: Lazy = Lazy::new(c"ibv_reg_dmabuf_mr");
static QUERY_GID_EX: Lazy = Lazy::new(c"_ibv_query_gid_ex");
static QUERY_GID_TABLE: Lazy = Lazy::new(c"_ibv_query_gid_table");

/// `ibv_reg_dmabuf_mr(3)` (IBVERBS_1.12, rdma-core 34): `Err(MissingSymbol)` when
/// libibverbs lacks it; otherwise the C call's result (NULL with errno set on failure).
///
/// # Safety
/// As `ibv_reg_dmabuf_mr(3)`: `pd` is a live protection domain, `fd` a dma-buf.
pub unsafe fn ibv_reg_dmabuf_mr(
    pd: *mut ibv_pd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> Result<*mut ibv_mr, MissingSymbol> {
    type F = unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
    let p = REG_DMABUF_MR.get("ibv_reg_dmabuf_mr", "rdma-core 34")?;
    // SAFETY: the symbol has this C signature in every rdma-core that exports it.
    let f: F = unsafe { std::mem::transmute::<*mut c_void, F>(p) };
    // SAFETY: the caller's contract.
    Ok(unsafe { f(pd, offset, length, iova, fd, access) })
}

/// `ibv_query_gid_ex(3)` (IBVERBS_1.11, rdma-core 32): `Err(MissingSymbol)` when
/// libibverbs lacks it; otherwise 0 or an errno value, as the C call.
///
/// # Safety
/// As `ibv_query_gid_ex(3)`: `context` is open, `entry` is writable.
pub unsafe fn ibv_query_gid_ex(
    context: *mut ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
) -> Result<c_int, MissingSymbol> {
    type F =
        unsafe extern "C" fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int;
    let p = QUERY_GID_EX.get("ibv_query_gid_ex", "rdma-core 32")?;
    // SAFETY: `_ibv_query_gid_ex`'s C signature (the inline passes sizeof(*entry)).
    let f: F = unsafe { std::mem::transmute::<*mut c_void, F>(p) };
    let size = size_of::<ibv_gid_entry>();
    // SAFETY: the caller's contract; `size` is the size of what `entry` points to.
    Ok(unsafe { f(context, port_num, gid_index, entry, flags, size) })
}

/// `ibv_query_gid_table(3)` (IBVERBS_1.11, rdma-core 32): `Err(MissingSymbol)` when
/// libibverbs lacks it; otherwise the number of entries or a negative errno.
///
/// # Safety
/// As `ibv_query_gid_table(3)`: `context` is open, `entries` has room for
/// `max_entries` entries.
pub unsafe fn ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
) -> Result<isize, MissingSymbol> {
    type F = unsafe extern "C" fn(*mut ibv_context, *mut ibv_gid_entry, usize, u32, usize) -> isize;
    let p = QUERY_GID_TABLE.get("ibv_query_gid_table", "rdma-core 32")?;
    // SAFETY: `_ibv_query_gid_table`'s C signature.
    let f: F = unsafe { std::mem::transmute::<*mut c_void, F>(p) };
    let size = size_of::<ibv_gid_entry>();
    // SAFETY: the caller's contract.
    Ok(unsafe { f(context, entries, max_entries, flags, size) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_symbol_is_unsupported() {
        static NOPE: Lazy = Lazy::new(c"ibv_no_such_verb_rdma_verbs_test");
        let e = NOPE.get("ibv_no_such_verb", "never").unwrap_err();
        assert_eq!(e.verb, "ibv_no_such_verb");
        assert!(
            e.hint().contains("ibv_no_such_verb_rdma_verbs_test"),
            "{e:?}"
        );
    }

    #[test]
    fn present_symbols_resolve_on_this_system() {
        // The build's libibverbs (rdma-core >= 32 here) has the GID queries.
        assert!(QUERY_GID_EX.get("ibv_query_gid_ex", "32").is_ok());
        assert!(QUERY_GID_TABLE.get("ibv_query_gid_table", "32").is_ok());
    }
}

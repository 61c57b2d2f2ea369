//! One checked call for every verb: [`verb!`] runs the C function, checks its
//! result by that function's convention and names the function in the error
//! from the call itself, so no call site spells a verb's name by hand.
//!
//! The caller writes the `unsafe { ffi::ibv_x(..) }` block and its `// SAFETY:`
//! comment; the macro passes the block through with its own spans, so
//! `clippy::undocumented_unsafe_blocks` still asks for (and finds) the comment.

use std::io;

/// A verb that failed: the C function's name and the errno it reported.
///
/// `?` turns it into [`crate::Error::Verb`] (with the usual hint); a call site
/// that maps some errno to its own error reads [`VerbFailure::errno`] first.
#[derive(Debug)]
pub(crate) struct VerbFailure {
    /// The C function, e.g. `ibv_alloc_pd`.
    pub(crate) verb: &'static str,
    /// What it reported.
    pub(crate) source: io::Error,
}

impl VerbFailure {
    /// The failure of `verb`, with the calling thread's errno.
    #[cold]
    pub(crate) fn last(verb: &'static str) -> VerbFailure {
        VerbFailure {
            verb,
            source: last_errno(),
        }
    }

    /// The failure of `verb`, which returned the errno `code` (either sign).
    #[cold]
    pub(crate) fn code(verb: &'static str, code: i32) -> VerbFailure {
        VerbFailure {
            verb,
            source: errno(code),
        }
    }

    /// The raw errno.
    pub(crate) fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

/// The calling thread's errno as an `io::Error`; errno 0 (the call failed
/// without setting it) as an error that says so.
pub(crate) fn last_errno() -> io::Error {
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(0) {
        return io::Error::other("it failed without setting errno (a provider's own refusal)");
    }
    e
}

/// Sets the calling thread's errno to 0 before a verb that reports failure
/// through errno: a provider can fail in user space without setting it (siw's
/// `ibv_create_cq` was seen to), and the errno of an earlier, unrelated call
/// (a futex's or a non-blocking read's `EAGAIN`) would then name the failure.
#[inline]
pub(crate) fn clear_errno() {
    // SAFETY: __errno_location returns the calling thread's errno, valid for writes.
    unsafe { *libc::__errno_location() = 0 };
}

/// An errno value returned directly (ibv_* functions that return the errno).
pub(crate) fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code.saturating_abs())
}

/// The C name of a binding: `___ibv_query_port` (the header's current-ABI
/// symbol) is `ibv_query_port` to its users.
pub(crate) const fn c_name(binding: &'static str) -> &'static str {
    let mut rest = binding.as_bytes();
    while let [b'_', tail @ ..] = rest {
        rest = tail;
    }
    match std::str::from_utf8(rest) {
        Ok(name) => name,
        Err(_) => binding,
    }
}

/// Runs a verb and checks its result: `verb!(convention: unsafe { ffi::name(args) })`.
///
/// The conventions, as libibverbs and librdmacm use them:
/// - `ptr`: a pointer, NULL with errno set on failure → `Result<NonNull<T>, VerbFailure>`;
/// - `rc`: 0, or the errno itself (`ibv_modify_qp`, `ibv_query_*`,
///   `ibv_post_*`, `ibv_req_notify_cq`) → `Result<(), VerbFailure>`;
/// - `count`: a count, or a negative errno (`ibv_poll_cq`,
///   `ibv_query_gid_table`) → `Result<the count's type, VerbFailure>`;
/// - `errno`: 0, or nonzero with errno set (`rdma_*`, `ibv_get_cq_event`)
///   → `Result<(), VerbFailure>`.
///
/// The block is passed through as written, `unsafe` and braces as two token
/// trees with the caller's spans (so clippy finds the SAFETY comment above
/// the call; an `ident` fragment or a second use of `unsafe` would hide the
/// block from it). A `?` after the call, for a symbol loaded at run time,
/// returns from the caller as usual.
///
/// ```ignore
/// // SAFETY: valid context.
/// let raw = verb!(ptr: unsafe { ffi::ibv_alloc_pd(ctx.as_raw()) })?;
/// ```
macro_rules! verb {
    (ptr: $unsafe:tt $call:tt) => {{
        $crate::sys::call::clear_errno();
        match ::core::ptr::NonNull::new($unsafe $call) {
            Some(raw) => Ok(raw),
            None => Err($crate::sys::call::VerbFailure::last(
                $crate::sys::call::verb!(@name $call),
            )),
        }
    }};
    (rc: $unsafe:tt $call:tt) => {{
        match $unsafe $call {
            0 => Ok(()),
            rc => Err($crate::sys::call::VerbFailure::code(
                $crate::sys::call::verb!(@name $call),
                rc,
            )),
        }
    }};
    (count: $unsafe:tt $call:tt) => {{
        match $unsafe $call {
            n if n >= 0 => Ok(n),
            rc => Err($crate::sys::call::VerbFailure::code(
                $crate::sys::call::verb!(@name $call),
                rc as i32,
            )),
        }
    }};
    (errno: $unsafe:tt $call:tt) => {{
        $crate::sys::call::clear_errno();
        match $unsafe $call {
            0 => Ok(()),
            _ => Err($crate::sys::call::VerbFailure::last(
                $crate::sys::call::verb!(@name $call),
            )),
        }
    }};
    // The C function's name, from the call in the block (after its path).
    (@name { $verb:ident ( $($args:tt)* ) $($rest:tt)* }) => {{
        const NAME: &str = $crate::sys::call::c_name(stringify!($verb));
        NAME
    }};
    (@name { $module:ident :: $($rest:tt)* }) => {
        $crate::sys::call::verb!(@name { $($rest)* })
    };
}
pub(crate) use verb;

#[cfg(test)]
mod tests {
    use super::*;

    mod ffi {
        pub(super) unsafe fn ___ibv_fake(x: i32) -> i32 {
            x
        }
        pub(super) unsafe fn ibv_fake_ptr(p: *mut u8) -> *mut u8 {
            p
        }
        pub(super) unsafe fn ibv_fake_count(n: isize) -> isize {
            n
        }
    }

    #[test]
    fn names_come_from_the_call() {
        // SAFETY: a plain function without preconditions.
        let e = verb!(rc: unsafe { ffi::___ibv_fake(libc::EINVAL) }).unwrap_err();
        assert_eq!(e.verb, "ibv_fake");
        assert_eq!(e.errno(), Some(libc::EINVAL));
        // SAFETY: as above.
        let e = verb!(rc: unsafe { ffi::___ibv_fake(-libc::ENOMEM) }).unwrap_err();
        assert_eq!(e.errno(), Some(libc::ENOMEM));
        // SAFETY: as above.
        assert!(verb!(rc: unsafe { ffi::___ibv_fake(0) }).is_ok());
    }

    #[test]
    fn a_failure_without_errno_is_not_blamed_on_an_older_call() {
        // An earlier call's errno, as a futex or a non-blocking read leaves it.
        // SAFETY: the calling thread's errno, valid for writes.
        unsafe { *libc::__errno_location() = libc::EAGAIN };
        // SAFETY: a plain function without preconditions; it sets no errno.
        let e = verb!(ptr: unsafe { ffi::ibv_fake_ptr(std::ptr::null_mut()) }).unwrap_err();
        assert_eq!(e.errno(), None);
        assert!(
            e.source.to_string().contains("without setting errno"),
            "{}",
            e.source
        );
    }

    #[test]
    fn each_convention_reads_its_result() {
        let mut x = 0u8;
        // SAFETY: a plain function without preconditions.
        let p = verb!(ptr: unsafe { ffi::ibv_fake_ptr(&mut x) }).unwrap();
        assert_eq!(p.as_ptr(), &raw mut x);
        // SAFETY: as above.
        let e = verb!(ptr: unsafe { ffi::ibv_fake_ptr(std::ptr::null_mut()) }).unwrap_err();
        assert_eq!(e.verb, "ibv_fake_ptr");
        // SAFETY: as above.
        assert_eq!(verb!(count: unsafe { ffi::ibv_fake_count(7) }).unwrap(), 7);
        // SAFETY: as above.
        let e = verb!(count: unsafe { ffi::ibv_fake_count(-5) }).unwrap_err();
        assert_eq!((e.verb, e.errno()), ("ibv_fake_count", Some(5)));
        // SAFETY: as above.
        assert!(verb!(errno: unsafe { ffi::___ibv_fake(0) }).is_ok());
        // SAFETY: as above.
        let e = verb!(errno: unsafe { ffi::___ibv_fake(-1) }).unwrap_err();
        assert_eq!(e.verb, "ibv_fake");
    }

    #[test]
    fn c_names_lose_leading_underscores() {
        assert_eq!(c_name("___ibv_query_port"), "ibv_query_port");
        assert_eq!(c_name("rdma_listen"), "rdma_listen");
    }
}

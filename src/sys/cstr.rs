//! C strings from the verbs API into Rust `String`s.

use std::ffi::CStr;

/// Copies a C string into a `String` (lossy); empty for NULL.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
pub(crate) unsafe fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: guaranteed by the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Reads a fixed-size C char array up to its first NUL.
pub(crate) fn carray(a: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = a
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

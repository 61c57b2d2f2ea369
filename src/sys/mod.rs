//! The system layer under the safe API: the raw bindings live in
//! [`crate::ffi`]; this module holds what the wrappers share to call them.

pub(crate) mod addr_hash;
mod c_enum;
pub(crate) mod call;
pub(crate) mod cstr;
pub(crate) mod fd;
#[cfg(feature = "tokio")]
pub(crate) mod wake;

pub(crate) use c_enum::c_enum;

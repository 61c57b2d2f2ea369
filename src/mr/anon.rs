//! Anonymous memory mappings to register: on ordinary pages or on huge pages
//! (`MAP_HUGETLB`), which the NIC translates with far fewer entries.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use super::owned::OwnedMemory;
use super::{AccessFlags, Mr, page_size};
use crate::error::{Error, Result};
use crate::pd::Pd;

/// A huge page size, for [`AnonMemory::huge`] and [`Mr::new_huge`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HugePageSize {
    /// 2 MiB pages (x86-64, and AArch64 with 4 KiB base pages).
    Size2M,
    /// 1 GiB pages, where the CPU has them; usually reserved at boot only.
    Size1G,
}

impl HugePageSize {
    /// The page size in bytes.
    pub fn bytes(self) -> usize {
        match self {
            HugePageSize::Size2M => 2 << 20,
            HugePageSize::Size1G => 1 << 30,
        }
    }
}

/// An anonymous, private, zero-filled memory mapping, owned: unmapped on drop.
///
/// Register it with [`Mr::register`] (or [`Mr::new_huge`] in one step) and
/// get it back with [`Mr::into_buffer`]. The pages are populated when it is
/// created, so a registration pins pages that belong to it alone.
pub struct AnonMemory {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    huge: Option<HugePageSize>,
}

// SAFETY: the mapping is owned by the value alone, like a Box<[u8]>.
unsafe impl Send for AnonMemory {}
// SAFETY: &AnonMemory gives out only shared slices.
unsafe impl Sync for AnonMemory {}

impl AnonMemory {
    /// Maps `len` zeroed bytes on ordinary pages.
    pub fn new(len: usize) -> Result<AnonMemory> {
        map(len, None)
    }

    /// Maps `len` zeroed bytes on huge pages of `size`, rounded up to whole
    /// pages. With too few free huge pages reserved the error is
    /// [`Error::HugePagesUnavailable`], which says how to reserve them.
    pub fn huge(len: usize, size: HugePageSize) -> Result<AnonMemory> {
        map(len, Some(size))
    }

    /// [`AnonMemory::huge`], or ordinary pages when the huge pages are not
    /// available; [`AnonMemory::huge_pages`] tells which it got.
    pub fn huge_or_base(len: usize, size: HugePageSize) -> Result<AnonMemory> {
        match map(len, Some(size)) {
            Err(Error::HugePagesUnavailable { .. }) => map(len, None),
            other => other,
        }
    }

    /// The huge page size backing it, `None` for ordinary pages.
    pub fn huge_pages(&self) -> Option<HugePageSize> {
        self.huge
    }
}

/// `mmap`s `len` bytes (whole pages of the chosen size), populated.
fn map(len: usize, huge: Option<HugePageSize>) -> Result<AnonMemory> {
    if len == 0 {
        return Err(Error::InvalidArgument {
            what: "mapping length",
            reason: "must be at least 1 byte".into(),
        });
    }
    let page = huge.map_or_else(page_size, HugePageSize::bytes);
    let map_len = len
        .checked_next_multiple_of(page)
        .ok_or_else(|| Error::InvalidArgument {
            what: "mapping length",
            reason: format!("{len} bytes is too large"),
        })?;
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
    if huge.is_some() {
        // MAP_HUGE_SHIFT is 26: the page size's log2 goes in the bits above it.
        flags |= libc::MAP_HUGETLB | ((page.trailing_zeros() as i32) << 26);
    }
    // SAFETY: a fresh anonymous mapping at an address the kernel picks; no
    // existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        let no_pages = matches!(e.raw_os_error(), Some(libc::ENOMEM | libc::EINVAL));
        return Err(match huge {
            Some(size) if no_pages => huge_error(len, size),
            _ => Error::Io {
                what: "mapping anonymous memory (mmap)",
                source: e,
            },
        });
    }
    let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| Error::InvalidArgument {
        what: "mapping",
        reason: "mmap returned address 0".into(),
    })?;
    Ok(AnonMemory {
        ptr,
        len,
        map_len,
        huge,
    })
}

/// The error for huge pages that could not be mapped, with the counts from sysfs.
fn huge_error(len: usize, size: HugePageSize) -> Error {
    let page = size.bytes();
    let count = |file: &str| {
        let path = format!(
            "/sys/kernel/mm/hugepages/hugepages-{}kB/{file}",
            page / 1024
        );
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    Error::HugePagesUnavailable {
        len,
        page_size: page,
        pages: len.div_ceil(page) as u64,
        free: count("free_hugepages"),
        total: count("nr_hugepages"),
    }
}

impl Deref for AnonMemory {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes of the mapping, owned by `self` and mapped
        // read-write until drop; `&self` keeps writers out.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AnonMemory {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AnonMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of `map_len` bytes (whole pages of
        // its size), unmapped once; no slice of it outlives `self`. munmap
        // fails only for bad arguments, which these are not.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

impl fmt::Debug for AnonMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnonMemory")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("huge", &self.huge)
            .finish()
    }
}

// SAFETY: the mapping stays at its address until drop, belongs to the value
// alone, and is readable and writable for `len` bytes.
unsafe impl OwnedMemory for AnonMemory {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.ptr.as_ptr(), self.len)
    }
}

impl Mr {
    /// Maps `len` zeroed bytes on huge pages of `size` and registers them:
    /// [`AnonMemory::huge`] then [`Mr::register`]. Huge pages need far fewer
    /// translation entries in the NIC and register faster (figures in
    /// docs/performance.md). [`Mr::into_buffer`] gives back the
    /// [`AnonMemory`].
    ///
    /// With too few free huge pages the error is
    /// [`Error::HugePagesUnavailable`], which says how to reserve them; for a
    /// fallback to ordinary pages, register [`AnonMemory::huge_or_base`].
    pub fn new_huge(pd: &Pd, len: usize, access: AccessFlags, size: HugePageSize) -> Result<Mr> {
        Mr::register(pd, AnonMemory::huge(len, size)?, access)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_memory_is_zeroed_writable_and_page_aligned() {
        let mut m = AnonMemory::new(5000).unwrap();
        assert_eq!((m.len(), m.huge_pages()), (5000, None));
        assert_eq!(m.as_ptr() as usize % page_size(), 0);
        assert!(m.iter().all(|&b| b == 0));
        m[4999] = 7;
        assert_eq!(m[4999], 7);
        assert!(matches!(
            AnonMemory::new(0),
            Err(Error::InvalidArgument {
                what: "mapping length",
                ..
            })
        ));
    }

    #[test]
    fn huge_page_refusal_names_the_command() {
        let e = Error::HugePagesUnavailable {
            len: 5 << 20,
            page_size: 2 << 20,
            pages: 3,
            free: 1,
            total: 4,
        };
        let msg = e.to_string();
        assert!(
            msg.contains("echo 6 > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),
            "{msg}"
        );
        // Whatever the host has reserved, the fallback maps something.
        let m = AnonMemory::huge_or_base(3 << 20, HugePageSize::Size2M).unwrap();
        assert_eq!(m.len(), 3 << 20);
    }
}

//! GPU memory over RDMA (feature `gdr`): registering CUDA device memory with
//! the NIC (GPUDirect RDMA, via dma-buf or nvidia-peermem), and a staging
//! fallback through host memory for machines without GPUDirect.
//!
//! CUDA is reached through [cudarc] (re-exported as [`gdr::cudarc`](cudarc)),
//! loaded at run time: the crate builds without the CUDA toolkit, and without
//! the NVIDIA driver every function here that needs CUDA returns
//! [`GdrError::DriverNotAvailable`] instead of panicking. Sizes, offsets and
//! addresses are checked: bad input is a typed error, never a panic.
//!
//! # Two ways in
//! * [`register()`]: device memory as an [`Mr`](crate::mr::Mr) (dma-buf or peer-mem)
//!   for peers to READ/WRITE or for your own work requests; its
//!   [`addr`](crate::mr::Mr::addr) is the device address. **Synchronize the stream
//!   that wrote the data before posting it**, and launch consumers of a peer's
//!   WRITE only after its completion.
//! * [`GpuBuffer`]: "send this device buffer to that remote MR", over GPUDirect
//!   RDMA when it can, otherwise through registered host bounce buffers
//!   ([`StagingConfig`]), chunked and double-buffered. It synchronizes the
//!   stream itself and takes back only its own completions: others come back in
//!   [`Transfer::others`].
//!
//! ```no_run
//! use rdma_verbs::gdr::{self, DeviceAlloc, GdrMode, GpuBuffer};
//! # fn f(pd: &rdma_verbs::pd::Pd, qp: &mut rdma_verbs::qp::Qp<rdma_verbs::qp::Rc, rdma_verbs::qp::Rts>,
//! #      cq: &mut rdma_verbs::cq::Cq, remote: rdma_verbs::mr::RemoteMr) -> rdma_verbs::Result<()> {
//! let ctx = gdr::cuda_context(0)?; // typed error, not a panic, without a GPU
//! let mut mem = DeviceAlloc::new(&ctx.default_stream(), 1 << 20)?;
//! gdr::copy_to_device(&mut mem, 0, &[7u8; 1 << 20])?;
//! let mut buf = GpuBuffer::new(pd, mem, GdrMode::Auto)?;
//! let t = buf.write(qp, cq, remote, 0)?;
//! println!("{} bytes via {} at {:.2} GB/s", t.bytes, t.path, t.gb_per_s());
//! # Ok(()) }
//! ```
//!
//! [`probe`] observes the machine ([`Capabilities`]) and [`decide`], a pure
//! function, turns that and the [`GdrMode`] into the paths to try, best first;
//! when nothing works, [`GdrError::NoPath`] lists every [`Missing`] piece and
//! every failed attempt, each with what to do.

pub use cudarc;

mod buffer;
mod direct;
mod driver;
mod ledger;
mod memory;
mod plan;
mod register;
mod select;
mod staging;

pub use crate::error::gdr::{AttemptFailure, GdrError};
pub use crate::values::gdr::{GdrMode, GdrPath, MemoryKind, Missing};
pub use buffer::{GpuBuffer, Transfer};
pub use driver::{check_driver, cuda_context, device_count};
pub use ledger::WR_ID_TAG;
pub use memory::{
    DeviceAlloc, DeviceMemory, DeviceRange, PlainBytes, copy_from_device, copy_to_device,
};
pub use register::{
    DmaBufExport, ExportWindow, GPU_PAGE_SIZE, Registration, export_dma_buf, export_window,
    peermem_loaded, probe, register, set_sync_memops, sync_memops,
};
pub use select::{Capabilities, Decision, decide};
pub use staging::StagingConfig;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn export_window_aligns_to_gpu_pages() {
        let w = export_window(0x7f00_0001_2345, 100, None, 4096).unwrap();
        assert_eq!(w.base, 0x7f00_0001_0000);
        assert_eq!(w.size, 0x1_0000);
        assert_eq!(w.offset, 0x2345);
        assert_eq!(w.base % GPU_PAGE_SIZE as u64, 0);
        assert!(w.base + w.offset == 0x7f00_0001_2345);
    }

    #[test]
    fn export_window_spans_pages_and_covers_the_range() {
        for (ptr, len) in [
            (0x20_0000u64, 1usize),
            (0x20_ffff, 2),
            (0x21_0000, 0x1_0000),
            (0x2f_fff0, 0x100_0000),
        ] {
            let w = export_window(ptr, len, None, 4096).unwrap();
            assert!(w.base <= ptr);
            assert!(w.base + w.size as u64 >= ptr + len as u64);
            assert_eq!(w.base % GPU_PAGE_SIZE as u64, 0);
            assert_eq!(w.size % GPU_PAGE_SIZE, 0);
            assert_eq!(w.offset, ptr - w.base);
        }
    }

    #[test]
    fn export_window_stays_in_the_allocation_with_host_pages() {
        // A 12 KiB allocation at a 4 KiB (not 64 KiB) boundary.
        let alloc = (0x10_3000u64, 0x3000usize);
        let w = export_window(0x10_3100, 0x100, Some(alloc), 4096).unwrap();
        assert_eq!(w.base, 0x10_3000);
        assert_eq!(w.size, 0x1000);
        assert_eq!(w.offset, 0x100);
        // Inside a big aligned allocation, GPU pages are kept.
        let w = export_window(0x40_1000, 10, Some((0x40_0000, 0x20_0000)), 4096).unwrap();
        assert_eq!((w.base, w.size), (0x40_0000, 0x1_0000));
    }

    #[test]
    fn export_window_honours_big_host_pages() {
        let w = export_window(0x123_4567, 1, None, 1 << 21).unwrap();
        assert_eq!(w.base % (1 << 21), 0);
        assert_eq!(w.size, 1 << 21);
    }

    #[test]
    fn export_window_rejects_overflow() {
        assert!(export_window(u64::MAX - 10, 100, None, 4096).is_none());
        // A host page size with no power of two above it: None, not a panic.
        assert!(export_window(0x10_0000, 1, None, usize::MAX).is_none());
        assert!(export_window(0x10_0000, 1, None, (1 << 63) + 1).is_none());
        assert!(export_window(0x10_0000, 1, Some((0x10_0000, 1)), usize::MAX).is_none());
        // The largest power of two still works.
        let w = export_window(0x10_0000, 1, None, 1 << 63).unwrap();
        assert_eq!((w.base, w.offset), (0, 0x10_0000));
        // An allocation that ends past the address space.
        assert!(export_window(0x10_0000, 1, Some((u64::MAX, 2)), 4096).is_none());
    }

    #[test]
    fn sub_ranges_are_checked() {
        assert_eq!(memory::sub_range(0x1000, 100, 10, 90).unwrap(), 0x100a);
        assert!(memory::sub_range(0x1000, 100, 10, 91).is_err());
        assert!(memory::sub_range(0x1000, usize::MAX, usize::MAX, 1).is_err());
        assert!(memory::sub_range(u64::MAX - 4, usize::MAX, 10, 0).is_err());
    }

    #[test]
    fn staging_configs_are_validated() {
        assert!(StagingConfig::default().validate().is_ok());
        let ok = StagingConfig {
            chunk_size: StagingConfig::MAX_CHUNK_SIZE,
            buffers: StagingConfig::MAX_BUFFERS,
            pin: false,
        };
        assert!(ok.validate().is_ok());
        for bad in [
            StagingConfig { buffers: 0, ..ok },
            StagingConfig {
                buffers: StagingConfig::MAX_BUFFERS + 1,
                ..ok
            },
            StagingConfig {
                buffers: usize::MAX,
                ..ok
            },
            StagingConfig {
                chunk_size: 0,
                ..ok
            },
            StagingConfig {
                chunk_size: StagingConfig::MAX_CHUNK_SIZE + 1,
                ..ok
            },
            StagingConfig {
                chunk_size: usize::MAX,
                ..ok
            },
        ] {
            let e = bad.validate().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{bad:?}: {e:?}");
        }
    }

    #[test]
    fn no_path_lists_every_piece() {
        let e = GdrError::NoPath {
            mode: GdrMode::Auto,
            missing: vec![Missing::DmaBuf, Missing::PeerMem],
            failures: vec![],
        };
        let s = e.to_string();
        assert!(s.contains("modprobe nvidia-peermem"), "{s}");
        assert!(s.contains("5.12"), "{s}");
        assert!(s.contains("`auto`"), "{s}");
    }

    #[test]
    fn attempt_failure_hints() {
        let a = AttemptFailure {
            path: GdrPath::DmaBuf,
            error: Box::new(Error::verb(
                "ibv_reg_dmabuf_mr",
                crate::error::errno(libc::EOPNOTSUPP),
            )),
            allocation_rdma_capable: Some(false),
        };
        let s = a.to_string();
        assert!(s.contains("cannot register dma-bufs"), "{s}");
        assert!(s.contains("cuMemAlloc"), "{s}");
    }

    #[test]
    fn cuda_error_names_the_call() {
        let e = driver::cuda_error(
            "cuMemGetHandleForAddressRange",
            cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
        );
        let s = e.to_string();
        assert!(
            s.starts_with("cuMemGetHandleForAddressRange failed: CUDA_ERROR_NOT_SUPPORTED (801)"),
            "{s}"
        );
        assert!(s.contains("open kernel modules"), "{s}");
    }

    #[test]
    fn memory_kinds_print() {
        assert_eq!(MemoryKind::Device.to_string(), "device");
        assert!(
            Missing::DeviceMemory(MemoryKind::Managed)
                .to_string()
                .contains("managed")
        );
    }
}

//! Host tests of the `gdr` feature that need neither a GPU nor an RDMA device:
//! the path decision over every combination of observed capabilities, and
//! that without a CUDA driver every entry point fails with the typed
//! "CUDA driver not available" error instead of panicking.
#![cfg(feature = "gdr")]

use std::collections::HashSet;
use std::sync::Arc;

use rdma_verbs::Error;
use rdma_verbs::gdr::cudarc::driver::CudaStream;
use rdma_verbs::gdr::cudarc::driver::sys::CUdeviceptr;
use rdma_verbs::gdr::{
    self, Capabilities, Decision, DeviceMemory, GdrError, GdrMode, GdrPath, MemoryKind, Missing,
    StagingConfig, decide,
};
use rdma_verbs::mr::AccessFlags;

const MODES: [GdrMode; 4] = [
    GdrMode::Auto,
    GdrMode::DmaBuf,
    GdrMode::PeerMem,
    GdrMode::Staging,
];
const KINDS: [MemoryKind; 5] = [
    MemoryKind::Device,
    MemoryKind::Managed,
    MemoryKind::HostPinned,
    MemoryKind::NotCuda,
    MemoryKind::Unknown,
];
const TRI: [Option<bool>; 3] = [None, Some(false), Some(true)];

/// Every combination of what `probe` can observe.
fn all_capabilities() -> Vec<Capabilities> {
    let mut v = Vec::new();
    for driver in [false, true] {
        for memory in KINDS {
            for gpudirect_rdma in TRI {
                for allocation_rdma_capable in TRI {
                    for dma_buf in [false, true] {
                        for peermem in [false, true] {
                            v.push(Capabilities {
                                driver,
                                memory,
                                gpudirect_rdma,
                                allocation_rdma_capable,
                                dma_buf,
                                peermem,
                            });
                        }
                    }
                }
            }
        }
    }
    v
}

#[test]
fn decision_properties_hold_for_every_combination() {
    let all = all_capabilities();
    assert_eq!(all.len(), 2 * 5 * 3 * 3 * 2 * 2);
    let mut seen = HashSet::new();
    for mode in MODES {
        for c in &all {
            assert!(seen.insert((mode, *c)), "duplicate combination");
            let d = decide(mode, c);
            let ctx = format!("mode {mode:?}, {c:?} -> {d:?}");
            // Deterministic.
            assert_eq!(d, decide(mode, c), "{ctx}");
            // Informational field: never changes the decision.
            let mut c2 = *c;
            c2.allocation_rdma_capable = None;
            assert_eq!(d, decide(mode, &c2), "{ctx}");

            let paths = d.paths();
            match &d {
                Decision::Refuse(m) => {
                    assert!(paths.is_empty(), "{ctx}");
                    assert!(!m.is_empty(), "a refusal must say why: {ctx}");
                }
                Decision::Try { paths, .. } => assert!(!paths.is_empty(), "{ctx}"),
            }
            // Best first, no repeats.
            assert!(paths.windows(2).all(|w| w[0] < w[1]), "{ctx}");

            let direct_ok =
                c.driver && c.memory == MemoryKind::Device && c.gpudirect_rdma != Some(false);
            assert_eq!(
                paths.contains(&GdrPath::DmaBuf),
                direct_ok && c.dma_buf && matches!(mode, GdrMode::Auto | GdrMode::DmaBuf),
                "{ctx}"
            );
            assert_eq!(
                paths.contains(&GdrPath::PeerMem),
                direct_ok && c.peermem && matches!(mode, GdrMode::Auto | GdrMode::PeerMem),
                "{ctx}"
            );
            assert_eq!(
                paths.contains(&GdrPath::Staging),
                c.driver
                    && matches!(c.memory, MemoryKind::Device | MemoryKind::Managed)
                    && matches!(mode, GdrMode::Auto | GdrMode::Staging),
                "{ctx}"
            );

            // Every missing piece named is really missing.
            for m in d.missing() {
                let really = match m {
                    Missing::CudaDriver => !c.driver,
                    Missing::DeviceMemory(k) => *k == c.memory && c.memory != MemoryKind::Device,
                    Missing::GpuDirectRdma => c.gpudirect_rdma == Some(false),
                    Missing::DmaBuf => !c.dma_buf,
                    Missing::PeerMem => !c.peermem,
                };
                assert!(really, "{m:?} named but present: {ctx}");
            }
            // No driver: that is the one thing to fix first.
            if !c.driver {
                assert_eq!(d, Decision::Refuse(vec![Missing::CudaDriver]), "{ctx}");
            }
            // A direct path the mode asks for and the memory allows, but that is not
            // in the list, is explained by its missing piece.
            if direct_ok && matches!(mode, GdrMode::Auto | GdrMode::DmaBuf) && !c.dma_buf {
                assert!(d.missing().contains(&Missing::DmaBuf), "{ctx}");
            }
            if direct_ok && matches!(mode, GdrMode::Auto | GdrMode::PeerMem) && !c.peermem {
                assert!(d.missing().contains(&Missing::PeerMem), "{ctx}");
            }
            if c.driver
                && c.gpudirect_rdma == Some(false)
                && c.memory == MemoryKind::Device
                && mode != GdrMode::Staging
            {
                assert!(d.missing().contains(&Missing::GpuDirectRdma), "{ctx}");
            }
            // Staging mode never mentions direct-path pieces.
            if mode == GdrMode::Staging {
                assert!(
                    d.missing()
                        .iter()
                        .all(|m| matches!(m, Missing::CudaDriver | Missing::DeviceMemory(_))),
                    "{ctx}"
                );
            }
        }
    }
    assert_eq!(seen.len(), 4 * all.len());
}

fn caps(memory: MemoryKind, dma_buf: bool, peermem: bool) -> Capabilities {
    Capabilities {
        driver: true,
        memory,
        gpudirect_rdma: Some(true),
        allocation_rdma_capable: Some(true),
        dma_buf,
        peermem,
    }
}

#[test]
fn decision_table_spot_checks() {
    use GdrPath::*;
    let dev = MemoryKind::Device;
    let tried = |mode, c: Capabilities| decide(mode, &c);
    assert_eq!(
        tried(GdrMode::Auto, caps(dev, true, true)),
        Decision::Try {
            paths: vec![DmaBuf, PeerMem, Staging],
            skipped: vec![]
        }
    );
    assert_eq!(
        tried(GdrMode::Auto, caps(dev, false, true)),
        Decision::Try {
            paths: vec![PeerMem, Staging],
            skipped: vec![Missing::DmaBuf]
        }
    );
    assert_eq!(
        tried(GdrMode::Auto, caps(dev, false, false)),
        Decision::Try {
            paths: vec![Staging],
            skipped: vec![Missing::DmaBuf, Missing::PeerMem]
        }
    );
    assert_eq!(
        tried(GdrMode::DmaBuf, caps(dev, false, true)),
        Decision::Refuse(vec![Missing::DmaBuf])
    );
    assert_eq!(
        tried(GdrMode::PeerMem, caps(dev, true, false)),
        Decision::Refuse(vec![Missing::PeerMem])
    );
    assert_eq!(
        tried(GdrMode::Staging, caps(dev, true, true)),
        Decision::Try {
            paths: vec![Staging],
            skipped: vec![]
        }
    );
    assert_eq!(
        tried(GdrMode::Auto, caps(MemoryKind::Managed, true, true)),
        Decision::Try {
            paths: vec![Staging],
            skipped: vec![Missing::DeviceMemory(MemoryKind::Managed)]
        }
    );
    assert_eq!(
        tried(GdrMode::PeerMem, caps(MemoryKind::HostPinned, true, true)),
        Decision::Refuse(vec![Missing::DeviceMemory(MemoryKind::HostPinned)])
    );
    let mut no_gdr = caps(dev, true, true);
    no_gdr.gpudirect_rdma = Some(false);
    assert_eq!(
        tried(GdrMode::Auto, no_gdr),
        Decision::Try {
            paths: vec![Staging],
            skipped: vec![Missing::GpuDirectRdma]
        }
    );
    assert_eq!(
        tried(GdrMode::Auto, Capabilities::NO_DRIVER),
        Decision::Refuse(vec![Missing::CudaDriver])
    );
}

#[test]
fn modes_parse_and_print() {
    for m in MODES {
        assert_eq!(m.to_string().parse::<GdrMode>().unwrap(), m);
    }
    assert_eq!("dma-buf".parse::<GdrMode>().unwrap(), GdrMode::DmaBuf);
    assert!(matches!(
        "gpudirect".parse::<GdrMode>(),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(GdrMode::default(), GdrMode::Auto);
}

/// Device memory that is never touched: only handed to functions that must
/// stop at the missing driver.
struct Unreachable;

// SAFETY: used only when check_driver() failed; every gdr function checks the
// driver before looking at the range, so the (fake) address never reaches CUDA or a NIC.
unsafe impl DeviceMemory for Unreachable {
    fn device_range(&self) -> (CUdeviceptr, usize) {
        (0x7f00_0000_0000, 1 << 20)
    }

    fn stream(&self) -> Option<&Arc<CudaStream>> {
        None
    }
}

fn is_driver_missing(e: &Error) -> bool {
    matches!(e, Error::Gdr(GdrError::DriverNotAvailable { .. }))
}

#[test]
fn without_libcuda_every_entry_point_returns_the_typed_error() {
    if let Ok(v) = gdr::check_driver() {
        eprintln!("skipped: a CUDA driver ({v}) is present on this machine");
        return;
    }
    let e = gdr::check_driver().unwrap_err();
    assert!(is_driver_missing(&e), "{e:?}");
    let msg = e.to_string();
    assert!(msg.starts_with("CUDA driver not available"), "{msg}");
    assert!(msg.contains("libcuda"), "{msg}");

    assert!(is_driver_missing(&gdr::device_count().unwrap_err()));
    assert!(is_driver_missing(&gdr::cuda_context(0).unwrap_err()));

    let mut mem = Unreachable;
    assert_eq!(gdr::probe(&mem), Capabilities::NO_DRIVER);
    assert_eq!(
        decide(GdrMode::Auto, &gdr::probe(&mem)),
        Decision::Refuse(vec![Missing::CudaDriver])
    );
    let mut buf = [0u8; 16];
    assert!(is_driver_missing(
        &gdr::copy_from_device(&mem, 0, &mut buf).unwrap_err()
    ));
    assert!(is_driver_missing(
        &gdr::copy_to_device(&mut mem, 0, &buf).unwrap_err()
    ));
    assert!(is_driver_missing(
        &gdr::export_dma_buf(&mem, 0, 4096).unwrap_err()
    ));
    assert!(is_driver_missing(&gdr::set_sync_memops(&mem).unwrap_err()));
    assert!(is_driver_missing(&gdr::sync_memops(&mem).unwrap_err()));

    // The entry points that also need an RDMA protection domain: checked when
    // this machine has an RDMA device (the driver check comes first).
    match rdma_verbs::context::Context::open(None) {
        Ok(ctx) => {
            let pd = rdma_verbs::pd::Pd::new(&ctx).expect("pd");
            for mode in MODES {
                let e =
                    gdr::register(&pd, Unreachable, AccessFlags::LOCAL_WRITE, mode).unwrap_err();
                assert!(is_driver_missing(&e), "register {mode}: {e:?}");
                let e =
                    gdr::GpuBuffer::with_config(&pd, Unreachable, mode, StagingConfig::default())
                        .unwrap_err();
                assert!(is_driver_missing(&e), "GpuBuffer {mode}: {e:?}");
            }
        }
        Err(e) => eprintln!("register/GpuBuffer not exercised: no RDMA device here ({e})"),
    }
}

#[test]
fn the_driver_check_is_stable_and_never_panics() {
    // Loading is attempted once and cached; repeated calls agree.
    let a = gdr::check_driver().map_err(|e| e.to_string());
    let b = gdr::check_driver().map_err(|e| e.to_string());
    assert_eq!(a, b);
    let t = std::thread::spawn(gdr::check_driver).join();
    assert!(t.is_ok(), "check_driver panicked on another thread");
}

#[test]
fn no_path_error_reads_as_a_checklist() {
    let e: Error = GdrError::NoPath {
        mode: GdrMode::Auto,
        missing: vec![
            Missing::DmaBuf,
            Missing::PeerMem,
            Missing::DeviceMemory(MemoryKind::Managed),
        ],
        failures: vec![],
    }
    .into();
    let s = e.to_string();
    assert_eq!(s.matches("\n  - ").count(), 3, "{s}");
    assert!(s.contains("modprobe nvidia-peermem"), "{s}");
    assert!(s.contains("open kernel modules"), "{s}");
    assert!(s.contains("managed"), "{s}");
}

#[test]
fn bad_sizes_are_typed_errors_not_panics() {
    // Staging limits: checked before anything is allocated (or CUDA is asked).
    for bad in [
        StagingConfig {
            buffers: usize::MAX,
            ..StagingConfig::default()
        },
        StagingConfig {
            buffers: 0,
            ..StagingConfig::default()
        },
        StagingConfig {
            chunk_size: usize::MAX,
            ..StagingConfig::default()
        },
        StagingConfig {
            chunk_size: 0,
            ..StagingConfig::default()
        },
    ] {
        let e = bad.validate().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{bad:?}: {e:?}");
    }
    assert!(StagingConfig::default().validate().is_ok());
    // Page sizes and ranges that overflow: None, not an arithmetic panic.
    assert_eq!(gdr::export_window(0x20_0000, 1, None, usize::MAX), None);
    assert_eq!(gdr::export_window(u64::MAX, 1, None, 4096), None);
    assert_eq!(
        gdr::export_window(0x20_0000, 1, Some((u64::MAX - 1, 4)), 4096),
        None
    );
    // GpuBuffer refuses a bad config first, driver or not (needs a PD).
    if let Ok(ctx) = rdma_verbs::context::Context::open(None) {
        let pd = rdma_verbs::pd::Pd::new(&ctx).expect("pd");
        let bad = StagingConfig {
            buffers: usize::MAX,
            ..StagingConfig::default()
        };
        let e = gdr::GpuBuffer::with_config(&pd, Unreachable, GdrMode::Staging, bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    }
}

#[test]
fn handles_can_move_between_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<gdr::GpuBuffer>();
    send::<gdr::Registration>();
    send::<gdr::Transfer>();
    send_sync::<gdr::DeviceAlloc>();
    send_sync::<gdr::DeviceRange>();
    send_sync::<GdrError>();
    send_sync::<Error>();
}

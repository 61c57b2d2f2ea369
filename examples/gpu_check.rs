//! One-shot check of the `gdr` feature on a machine with an NVIDIA GPU
//! (`cargo xtask gpu-check`, or `cargo run --features gdr --example gpu_check
//! -- [--gpu N] [--device RDMA_DEV]`).
//!
//! It allocates device memory, reports `DMA_BUF_SUPPORTED`, exports a dma-buf
//! for an aligned range, sets `SYNC_MEMOPS`, exercises the staging copies with
//! data verification, tries the dma-buf, peer-mem and automatic registrations
//! against the RDMA device if there is one, and, when that device has an
//! active port, RDMA-WRITEs from GPU memory into a host MR over a loopback
//! connection on every path that is available and verifies the bytes.
//!
//! Exit status: 0 when every check that could run passed, 1 when one failed,
//! 2 when there is no usable CUDA driver or GPU. Results marked `EXPECTED` are
//! failures that are correct on this machine, e.g. "no RDMA NIC" on a GPU box
//! without one (the registrations then print the library's error for it), a
//! dma-buf registration refused by a software RDMA device (rxe/siw), or
//! peer-mem refused because nvidia-peermem is not loaded.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use rdma_verbs::device::{GidType, PortState};
use rdma_verbs::gdr::cudarc::driver::CudaContext;
use rdma_verbs::gdr::cudarc::driver::sys::CUdevice_attribute as Attr;
use rdma_verbs::gdr::{
    self, DeviceAlloc, DeviceMemory, GdrError, GdrMode, GdrPath, GpuBuffer, MemoryKind, Missing,
};
use rdma_verbs::prelude::*;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    Pass,
    Fail,
    Skip,
    Expected,
}

#[derive(Default)]
struct Report {
    rows: Vec<(Status, String, String)>,
}

impl Report {
    fn add(&mut self, status: Status, check: &str, detail: impl Into<String>) {
        let detail = detail.into();
        let tag = match status {
            Status::Pass => "PASS    ",
            Status::Fail => "FAIL    ",
            Status::Skip => "SKIP    ",
            Status::Expected => "EXPECTED",
        };
        println!("[{tag}] {check}: {detail}");
        self.rows.push((status, check.to_owned(), detail));
    }

    fn check(&mut self, ok: bool, check: &str, detail: impl Into<String>) -> bool {
        self.add(if ok { Status::Pass } else { Status::Fail }, check, detail);
        ok
    }

    fn count(&self, s: Status) -> usize {
        self.rows.iter().filter(|r| r.0 == s).count()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn main() -> ExitCode {
    let mut gpu = 0usize;
    let mut device: Option<String> = std::env::var("RDMA_VERBS_DEVICE").ok();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "-h" || a == "--help" {
            println!("usage: gpu_check [--gpu N] [--device RDMA_DEV]");
            return ExitCode::SUCCESS;
        }
        match (a.as_str(), args.next()) {
            ("--gpu", Some(v)) => gpu = v.parse().unwrap_or(0),
            ("--device", Some(v)) => device = Some(v),
            _ => {
                eprintln!("usage: gpu_check [--gpu N] [--device RDMA_DEV]");
                return ExitCode::from(2);
            }
        }
    }

    println!("== gdr gpu check ==");
    let version = match gdr::check_driver() {
        Ok(v) => v,
        Err(e) => {
            println!("[FAIL    ] CUDA driver: {e}");
            println!("this check needs a machine with an NVIDIA GPU and driver");
            return ExitCode::from(2);
        }
    };
    let ctx = match gdr::cuda_context(gpu) {
        Ok(c) => c,
        Err(e) => {
            println!("[FAIL    ] CUDA context on GPU {gpu}: {e}");
            return ExitCode::from(2);
        }
    };
    let mut r = Report::default();
    r.add(
        Status::Pass,
        "CUDA driver",
        format!(
            "version {}.{}, {} GPU(s)",
            version / 1000,
            (version % 1000) / 10,
            gdr::device_count().unwrap_or(0)
        ),
    );
    environment(&mut r, &ctx, gpu);

    let stream = ctx.default_stream();
    const LEN: usize = 4 << 20;
    let mem = match DeviceAlloc::new(&stream, LEN) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            r.add(Status::Fail, "cuMemAlloc 4 MiB", e.to_string());
            return finish(&r);
        }
    };
    r.add(
        Status::Pass,
        "cuMemAlloc 4 MiB",
        format!("device pointer {:#x}", mem.device_ptr()),
    );

    let caps = gdr::probe(&mem);
    r.check(
        caps.driver && caps.memory == MemoryKind::Device,
        "probe(cuMemAlloc memory)",
        format!("{caps:?}"),
    );
    // cudarc's own allocator (a stream-ordered pool where the GPU has one).
    match stream.alloc_zeros::<u8>(LEN) {
        Ok(slice) => {
            let c = gdr::probe(&slice);
            r.check(
                c.memory == MemoryKind::Device,
                "probe(cudarc CudaSlice)",
                format!(
                    "memory {}, IS_GPU_DIRECT_RDMA_CAPABLE {:?}",
                    c.memory, c.allocation_rdma_capable
                ),
            );
            staging_copies(&mut r, "CudaSlice", slice);
        }
        Err(e) => {
            r.add(Status::Fail, "cudarc alloc_zeros", format!("{e:?}"));
        }
    }

    sync_memops(&mut r, &mem);
    dma_buf_export(&mut r, &mem, caps.dma_buf);
    staging_copies(&mut r, "DeviceAlloc", mem.clone());

    rdma(&mut r, device.as_deref(), &stream, &caps);
    finish(&r)
}

fn finish(r: &Report) -> ExitCode {
    println!(
        "== {} passed, {} failed, {} expected failures, {} skipped ==",
        r.count(Status::Pass),
        r.count(Status::Fail),
        r.count(Status::Expected),
        r.count(Status::Skip)
    );
    if r.count(Status::Fail) == 0 {
        ExitCode::SUCCESS
    } else {
        for (s, c, d) in &r.rows {
            if *s == Status::Fail {
                println!("failed: {c}: {d}");
            }
        }
        ExitCode::FAILURE
    }
}

fn environment(r: &mut Report, ctx: &Arc<CudaContext>, gpu: usize) {
    let attr = |a| ctx.attribute(a).ok();
    let name = ctx.name().unwrap_or_else(|e| format!("? ({e:?})"));
    let pci = match (
        attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
        attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
        attr(Attr::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
    ) {
        (Some(d), Some(b), Some(s)) => format!("{d:04x}:{b:02x}:{s:02x}.0"),
        _ => "?".into(),
    };
    r.add(Status::Pass, "GPU", format!("{gpu}: {name} at PCI {pci}"));
    let dma = attr(Attr::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED);
    let gdr = attr(Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED);
    r.add(
        Status::Pass,
        "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED",
        format!("{dma:?}"),
    );
    r.add(
        Status::Pass,
        "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED",
        format!("{gdr:?}"),
    );
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let nv = std::fs::read_to_string("/proc/driver/nvidia/version").unwrap_or_default();
    let open = nv.contains("Open Kernel");
    r.add(
        Status::Pass,
        "kernel / NVIDIA module",
        format!(
            "Linux {}, {} kernel module ({})",
            kernel.trim(),
            if open {
                "open"
            } else {
                "proprietary or unknown"
            },
            nv.lines()
                .next()
                .unwrap_or("no /proc/driver/nvidia/version")
                .trim()
        ),
    );
    r.add(
        Status::Pass,
        "nvidia-peermem",
        if gdr::peermem_loaded() {
            "loaded"
        } else {
            "not loaded"
        },
    );
}

fn sync_memops(r: &mut Report, mem: &Arc<DeviceAlloc>) {
    match gdr::set_sync_memops(mem) {
        Ok(()) => {
            let read = gdr::sync_memops(mem);
            r.check(
                matches!(read, Ok(true)),
                "CU_POINTER_ATTRIBUTE_SYNC_MEMOPS",
                format!("set; reads back {read:?}"),
            );
        }
        Err(e) => {
            r.add(
                Status::Fail,
                "CU_POINTER_ATTRIBUTE_SYNC_MEMOPS",
                e.to_string(),
            );
        }
    }
}

fn dma_buf_export(r: &mut Report, mem: &Arc<DeviceAlloc>, supported: bool) {
    // An unaligned range in the middle: the export must widen it to GPU pages.
    let (off, len) = (70_000usize, 300_000usize);
    match gdr::export_dma_buf(mem, off, len) {
        Ok(x) => {
            let w = x.window;
            let start = mem.device_ptr() + off as u64;
            let aligned = w.base % gdr::GPU_PAGE_SIZE as u64 == 0 || w.base % 4096 == 0;
            let covers = w.base + w.offset == start && w.offset as usize + len <= w.size;
            let fd_ok = fd_is_open(&x.fd);
            r.check(
                supported && aligned && covers && fd_ok,
                "dma-buf export (cuMemGetHandleForAddressRange)",
                format!(
                    "window base {:#x} size {} offset {}, fd valid: {fd_ok}",
                    w.base, w.size, w.offset
                ),
            );
        }
        Err(e) if !supported => r.add(
            Status::Expected,
            "dma-buf export (cuMemGetHandleForAddressRange)",
            format!("DMA_BUF_SUPPORTED is 0 here: {e}"),
        ),
        Err(e) => r.add(
            Status::Fail,
            "dma-buf export (cuMemGetHandleForAddressRange)",
            e.to_string(),
        ),
    }
}

/// Whether `fd` is an open descriptor (it can be duplicated).
fn fd_is_open(fd: &std::os::fd::OwnedFd) -> bool {
    fd.try_clone().is_ok()
}

fn staging_copies<D: DeviceMemory>(r: &mut Report, what: &str, mut mem: D) {
    let len = mem.device_range().1;
    let name = format!("staging copies ({what})");
    let data = pattern(len, 3);
    let mut back = vec![0u8; len];
    let whole = gdr::copy_to_device(&mut mem, 0, &data)
        .and_then(|()| gdr::copy_from_device(&mem, 0, &mut back));
    if let Err(e) = whole {
        r.add(Status::Fail, &name, format!("H2D/D2H round trip: {e}"));
        return;
    }
    if back != data {
        let i = back
            .iter()
            .zip(&data)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        r.add(
            Status::Fail,
            &name,
            format!("round trip differs at byte {i}"),
        );
        return;
    }
    // Unaligned sub-ranges, as the staging path copies its chunks.
    let (off, n) = (12_345usize, 777_777usize.min(len - 12_345));
    let patch = pattern(n, 77);
    let mut got = vec![0u8; n];
    let part = gdr::copy_to_device(&mut mem, off, &patch)
        .and_then(|()| gdr::copy_from_device(&mem, off, &mut got));
    let mut around = vec![0u8; 16];
    let edge = gdr::copy_from_device(&mem, off - 16, &mut around);
    let ok = part.is_ok() && got == patch && edge.is_ok() && around[..] == data[off - 16..off];
    // Out of range must be refused, not copied.
    let oob = gdr::copy_from_device(&mem, len - 1, &mut [0u8; 2]);
    r.check(
        ok && matches!(oob, Err(Error::InvalidArgument { .. })),
        &name,
        format!(
            "{len} bytes H2D+D2H verified; sub-range [{off}, +{n}) verified, neighbours intact; \
             out-of-range refused: {}",
            oob.is_err()
        ),
    );
}

fn is_software(ctx: &Context) -> bool {
    let n = ctx.name();
    n.starts_with("rxe") || n.starts_with("siw")
}

fn rdma(
    r: &mut Report,
    device: Option<&str>,
    stream: &Arc<rdma_verbs::gdr::cudarc::driver::CudaStream>,
    caps: &gdr::Capabilities,
) {
    let ctx = match Context::open(device) {
        Ok(c) => c,
        Err(e) => {
            r.add(
                Status::Expected,
                "RDMA device",
                format!("expected on a box without an RDMA NIC: {e}"),
            );
            for check in [
                "register dma-buf",
                "register peer-mem",
                "register auto",
                "GpuBuffer staging",
            ] {
                r.add(Status::Skip, check, "no RDMA device");
            }
            return;
        }
    };
    r.add(Status::Pass, "RDMA device", ctx.name().to_owned());
    let pd = match Pd::new(&ctx) {
        Ok(p) => p,
        Err(e) => {
            r.add(Status::Fail, "ibv_alloc_pd", e.to_string());
            return;
        }
    };
    let mem = match DeviceAlloc::new(stream, 1 << 20) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            r.add(Status::Fail, "cuMemAlloc 1 MiB", e.to_string());
            return;
        }
    };
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let soft = is_software(&ctx);

    // dma-buf
    match gdr::register(&pd, mem.clone(), access, GdrMode::DmaBuf) {
        Ok(reg) => {
            let ok = reg.path == GdrPath::DmaBuf
                && reg.mr.addr() == mem.device_ptr()
                && reg.mr.len() == mem.len()
                && reg.mr.as_slice().is_err();
            r.check(
                ok,
                "register dma-buf",
                format!(
                    "{:?}, sync_memops {}; IOVA == device pointer, no host slice",
                    reg.mr, reg.sync_memops
                ),
            );
        }
        Err(e) if !caps.dma_buf || soft => r.add(
            Status::Expected,
            "register dma-buf",
            format!("(dma-buf unsupported by this GPU or RDMA device) {e}"),
        ),
        Err(e) => r.add(Status::Fail, "register dma-buf", e.to_string()),
    }
    // peer-mem
    match gdr::register(&pd, mem.clone(), access, GdrMode::PeerMem) {
        Ok(reg) => {
            r.check(
                reg.path == GdrPath::PeerMem && reg.mr.addr() == mem.device_ptr(),
                "register peer-mem",
                format!("{:?}", reg.mr),
            );
        }
        Err(e) if !caps.peermem || soft => r.add(
            Status::Expected,
            "register peer-mem",
            format!("(nvidia-peermem not loaded or software RDMA device) {e}"),
        ),
        Err(e) => r.add(Status::Fail, "register peer-mem", e.to_string()),
    }
    // auto
    let direct_expected = (caps.dma_buf || caps.peermem) && !soft;
    match gdr::register(&pd, mem.clone(), access, GdrMode::Auto) {
        Ok(reg) => r.add(
            Status::Pass,
            "register auto",
            format!(
                "path {}; skipped {:?}; failed {}",
                reg.path,
                reg.skipped,
                reg.failures.len()
            ),
        ),
        Err(e) if !direct_expected => r.add(
            Status::Expected,
            "register auto",
            format!("no GPUDirect path on this machine: {e}"),
        ),
        Err(e) => r.add(Status::Fail, "register auto", e.to_string()),
    }
    // The library must explain a refusal in terms of what is missing.
    if let Err(Error::Gdr(GdrError::NoPath { missing, .. })) =
        gdr::register(&pd, mem.clone(), access, GdrMode::PeerMem)
    {
        if !caps.peermem {
            r.check(
                missing.contains(&Missing::PeerMem),
                "peer-mem refusal names the module",
                format!("{missing:?}"),
            );
        }
    }

    loopback(r, &ctx, &pd, &mem);
}

/// Two connected RC QPs on one port, each with its CQ.
type Loopback = (Qp<Rc, Rts>, Cq, Qp<Rc, Rts>, Cq);

/// RDMA WRITEs from GPU memory over two QPs on one port, connected to each other.
fn loopback(r: &mut Report, ctx: &Context, pd: &Pd, mem: &Arc<DeviceAlloc>) {
    let port = match ctx.query_port(1) {
        Ok(p) if p.state == PortState::Active => p,
        Ok(p) => {
            r.add(
                Status::Skip,
                "loopback WRITE",
                format!("port 1 is {:?}", p.state),
            );
            return;
        }
        Err(e) => {
            r.add(Status::Fail, "query port 1", e.to_string());
            return;
        }
    };
    let gid = ctx
        .gid_table()
        .ok()
        .and_then(|t| {
            t.iter()
                .find(|e| {
                    e.port == 1
                        && e.gid_type == GidType::RoceV2
                        && e.gid.raw()[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]
                })
                .or_else(|| t.iter().find(|e| e.port == 1))
                .map(|e| e.index)
        })
        .unwrap_or(0);
    let setup = || -> rdma_verbs::Result<Loopback> {
        let caps = QpCaps {
            max_send_wr: 64,
            ..QpCaps::default()
        };
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let cq_a = Cq::new(ctx, 256)?;
        let cq_b = Cq::new(ctx, 256)?;
        let a = Qp::new(pd, &cq_a, &cq_a, caps)?.init(InitAttr::new(1, access))?;
        let b = Qp::new(pd, &cq_b, &cq_b, caps)?.init(InitAttr::new(1, access))?;
        let ea = a.endpoint(Some(gid))?;
        let eb = b.endpoint(Some(gid))?;
        Ok((
            a.connect(&eb, Some(gid))?,
            cq_a,
            b.connect(&ea, Some(gid))?,
            cq_b,
        ))
    };
    let (mut qp, mut cq, _peer, _peer_cq) = match setup() {
        Ok(x) => x,
        Err(e) => {
            r.add(
                Status::Fail,
                "loopback QPs",
                format!("{e} (port MTU {:?})", port.active_mtu),
            );
            return;
        }
    };
    let data = pattern(mem.len(), 11);
    let mut m = mem.clone();
    if let Err(e) = gdr::copy_to_device(&mut m, 0, &data) {
        r.add(
            Status::Fail,
            "loopback WRITE",
            format!("filling GPU memory: {e}"),
        );
        return;
    }
    for mode in [
        GdrMode::DmaBuf,
        GdrMode::PeerMem,
        GdrMode::Staging,
        GdrMode::Auto,
    ] {
        let check = format!("loopback WRITE ({mode})");
        let target = match pd.alloc_mr(
            mem.len(),
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ) {
            Ok(t) => t,
            Err(e) => {
                r.add(Status::Fail, &check, format!("target MR: {e}"));
                continue;
            }
        };
        // Small chunks so the staging path really pipelines several of them.
        let cfg = gdr::StagingConfig {
            chunk_size: 192 << 10,
            ..Default::default()
        };
        let mut buf = match GpuBuffer::with_config(pd, mem.clone(), mode, cfg) {
            Ok(b) => b,
            Err(e) => {
                r.add(Status::Skip, &check, format!("path unavailable: {e}"));
                continue;
            }
        };
        buf.set_timeout(Duration::from_secs(10));
        let res = buf.write(&mut qp, &mut cq, target.remote(), 0);
        match res {
            Ok(t) => {
                let got = target.to_vec().unwrap_or_default();
                r.check(
                    got == data,
                    &check,
                    format!(
                        "via {} ({} WRs, {:.2} GB/s), {} bytes verified: {}",
                        t.path,
                        t.work_requests,
                        t.gb_per_s(),
                        got.len(),
                        got == data
                    ),
                );
            }
            Err(e) => r.add(Status::Fail, &check, format!("via {}: {e}", buf.path())),
        }
    }
}

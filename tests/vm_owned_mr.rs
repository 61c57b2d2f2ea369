//! Registering memory the application owns, on real soft-RoCE: `Vec`, `Box`,
//! anonymous and file mappings registered in place, written and read by the
//! NIC, and given back; read-only mappings; huge pages; the raw path.

mod common;

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{Pair, all_remote, caps_sr, pair, pattern, res_counts, wait};
use rdma_verbs::mr::{AnonMemory, HugePageSize, MrRefused};
use rdma_verbs::prelude::*;

/// The tests compare the device's MR count: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn mr_count(p: &Pair) -> u64 {
    res_counts(p.ctx.name())["mr"]
}

/// `a` WRITEs `data` into `dst` (of `b`) at offset 0; the source comes back.
fn write_into(p: &mut Pair, dst: &Mr, data: &[u8]) {
    let mut src = p.pd.alloc_mr(data.len(), AccessFlags::empty()).unwrap();
    src.as_mut_slice().unwrap().copy_from_slice(data);
    p.a.post_send(SendWr::write(1, dst.remote(), 0).sge(src))
        .unwrap();
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{:?}", c[0]);
    assert_eq!(c[0].opcode, WcOpcode::RdmaWrite);
    assert!(c[0].take_mr().is_some(), "the source comes back");
}

/// `a` READs `len` bytes of `src` (of `b`) into a fresh MR and returns them (the mapped
/// files of the `memmap2` tests).
#[cfg(feature = "memmap2")]
fn read_from(p: &mut Pair, src: &Mr) -> Vec<u8> {
    let dest = p.pd.alloc_mr(src.len(), AccessFlags::LOCAL_WRITE).unwrap();
    p.a.post_send(SendWr::read(2, dest, src.remote(), 0))
        .unwrap();
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{:?}", c[0]);
    assert_eq!(c[0].opcode, WcOpcode::RdmaRead);
    c[0].take_mr().unwrap().to_vec().unwrap()
}

#[test]
fn vec_box_and_anon_memory_take_a_write_in_place_and_come_back() {
    let _g = serial();
    let mut p = pair(caps_sr(8, 8));
    let base = mr_count(&p);
    let len = 3 * 4096 + 17;

    // A Vec: its `len` bytes are registered, not its spare capacity.
    let mut v = Vec::with_capacity(len + 1000);
    v.resize(len, 0u8);
    let (addr, cap) = (v.as_ptr() as u64, v.capacity());
    let mr = Mr::register(&p.pd, v, all_remote()).unwrap();
    assert_eq!((mr.addr(), mr.len(), mr.region_len()), (addr, len, len));
    assert_eq!(mr_count(&p), base + 1);
    write_into(&mut p, &mr, &pattern(len, 1));
    let v: Vec<u8> = mr.into_buffer().unwrap();
    assert_eq!(
        (v.as_ptr() as u64, v.capacity()),
        (addr, cap),
        "the same Vec"
    );
    assert_eq!(v, pattern(len, 1));
    assert_eq!(mr_count(&p), base);

    // A Box<[u8]>.
    let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
    let addr = b.as_ptr() as u64;
    let mr = Mr::register(&p.pd, b, all_remote()).unwrap();
    assert_eq!(mr.addr(), addr);
    write_into(&mut p, &mr, &pattern(len, 2));
    let b: Box<[u8]> = mr.into_buffer().unwrap();
    assert_eq!((b.as_ptr() as u64, &b[..]), (addr, &pattern(len, 2)[..]));

    // An anonymous mapping, page-aligned.
    let m = AnonMemory::new(len).unwrap();
    assert_eq!(m.huge_pages(), None);
    let mr = Mr::register(&p.pd, m, all_remote()).unwrap();
    assert_eq!(mr.addr() % 4096, 0);
    write_into(&mut p, &mr, &pattern(len, 3));
    let m: AnonMemory = mr.into_buffer().unwrap();
    assert_eq!(&m[..], &pattern(len, 3)[..]);
    assert_eq!(mr_count(&p), base);
}

#[test]
fn an_owned_buffer_is_a_send_source_and_a_receive_target() {
    let _g = serial();
    let mut p = pair(caps_sr(8, 8));
    let data = pattern(5000, 7);
    let rbuf = Mr::register(&p.pd, vec![0u8; 6000], AccessFlags::LOCAL_WRITE).unwrap();
    p.b.post_recv(RecvWr::new(9, rbuf)).unwrap();
    let sbuf = Mr::register(&p.pd, data.clone(), AccessFlags::empty()).unwrap();
    assert_eq!(sbuf.as_slice().unwrap(), &data[..]);
    p.a.post_send(SendWr::send(8).sge(sbuf)).unwrap();
    let mut sc = wait(&mut p.cq_a, 1);
    assert_eq!(sc[0].status, WcStatus::Success, "{:?}", sc[0]);
    let back: Vec<u8> = sc[0].take_mr().unwrap().into_buffer().unwrap();
    assert_eq!(back, data, "the send source comes back unchanged");
    let mut rc = wait(&mut p.cq_b, 1);
    assert_eq!((rc[0].status, rc[0].byte_len), (WcStatus::Success, 5000));
    let got: Vec<u8> = rc[0].take_mr().unwrap().into_buffer().unwrap();
    assert_eq!(&got[..5000], &data[..]);
    assert!(got[5000..].iter().all(|&b| b == 0));
}

#[test]
fn empty_buffers_are_refused_and_nothing_is_registered() {
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let base = mr_count(&p);
    let refusals = [
        Mr::register(&p.pd, Vec::new(), AccessFlags::LOCAL_WRITE).err(),
        Mr::register(&p.pd, Vec::with_capacity(4096), AccessFlags::LOCAL_WRITE).err(),
        Mr::register(&p.pd, Box::<[u8]>::default(), AccessFlags::empty()).err(),
    ];
    for e in refusals {
        assert!(
            matches!(
                e,
                Some(Error::InvalidArgument {
                    what: "MR length",
                    ..
                })
            ),
            "{e:?}"
        );
    }
    assert!(matches!(
        AnonMemory::new(0),
        Err(Error::InvalidArgument {
            what: "mapping length",
            ..
        })
    ));
    // SAFETY: zero bytes: nothing is accessed, and the call refuses it.
    let raw = unsafe {
        Mr::register_raw(
            &p.pd,
            std::ptr::NonNull::dangling().as_ptr(),
            0,
            AccessFlags::empty(),
            (),
        )
    };
    assert!(matches!(
        raw,
        Err(Error::InvalidArgument {
            what: "MR length",
            ..
        })
    ));
    assert_eq!(mr_count(&p), base);
}

/// `mr.into_buffer::<Vec<u8>>()` must refuse with this reason fragment.
fn refused(r: Result<Vec<u8>, MrRefused>, why: &str) -> Mr {
    let e = r.expect_err("into_buffer should refuse");
    assert!(
        matches!(
            e.error,
            Error::InvalidArgument {
                what: "Mr::into_buffer",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains(why), "{e}");
    e.mr
}

#[test]
fn a_split_or_shared_mr_gives_the_buffer_back_only_when_whole() {
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let base = mr_count(&p);
    let mut a = Mr::register(&p.pd, pattern(100, 5), AccessFlags::empty()).unwrap();
    let b = a.split_off(40).unwrap();
    let mut a = refused(a.into_buffer(), "bytes [0, 40) of a 100-byte registration");
    let b = refused(b.into_buffer(), "bytes [40, 100)");
    // Another buffer type, and a registration with no buffer behind it.
    let a2 = a.into_buffer::<Box<[u8]>>().expect_err("not a Box");
    assert!(a2.to_string().contains("is a alloc::vec::Vec<u8>"), "{a2}");
    a = a2.mr;
    let heap = p.pd.alloc_mr(8, AccessFlags::empty()).unwrap();
    refused(heap.into_buffer(), "not registered with Mr::register");
    // Whole again, but an empty piece cut off the end still shares it.
    a.unsplit(b).unwrap();
    let empty = a.split_off(100).unwrap();
    assert_eq!((a.len(), empty.len()), (100, 0));
    let a = refused(a.into_buffer(), "another handle shares this registration");
    drop(empty);
    drop(a);
    assert_eq!(mr_count(&p), base, "dropping the pieces deregisters");
}

#[test]
fn a_rejoined_mr_gives_the_buffer_back() {
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let mut a = Mr::register(&p.pd, pattern(100, 6), AccessFlags::empty()).unwrap();
    let b = a.split_off(40).unwrap();
    a.unsplit(b).unwrap();
    let shared = a.freeze();
    let clone = shared.clone();
    drop(clone);
    let v: Vec<u8> = shared.try_unfreeze().unwrap().into_buffer().unwrap();
    assert_eq!(v, pattern(100, 6));
}

/// Sets a flag when dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn register_raw_keeps_its_keepalive_until_the_registration_ends() {
    let _g = serial();
    let mut p = pair(caps_sr(8, 8));
    let base = mr_count(&p);
    let mut mem = vec![0u8; 4096];
    let ptr = mem.as_mut_ptr();
    let dropped = Arc::new(AtomicBool::new(false));
    let keep = (mem, DropFlag(dropped.clone()));
    // SAFETY: `keep` owns the 4096 bytes at `ptr` (a Vec's heap buffer does
    // not move with it) and nothing else touches them until it is dropped.
    let mut mr =
        unsafe { Mr::register_raw(&p.pd, ptr, 4096, AccessFlags::LOCAL_WRITE, keep) }.unwrap();
    let mut tail = mr.split_off(2048).unwrap();
    tail.write_at(0, &pattern(2048, 9)).unwrap();
    let mut shared = tail.freeze();
    let dst = Mr::register(&p.pd, vec![0u8; 2048], all_remote()).unwrap();
    p.a.post_send(SendWr::write(3, dst.remote(), 0).sge(shared.clone()))
        .unwrap();
    assert_eq!(wait(&mut p.cq_a, 1)[0].status, WcStatus::Success);
    let got: Vec<u8> = dst.into_buffer().unwrap();
    assert_eq!(got, pattern(2048, 9));
    drop(mr);
    assert!(!dropped.load(Ordering::SeqCst), "a piece still lives");
    shared = shared.slice(0, 1).unwrap();
    drop(shared);
    assert!(
        dropped.load(Ordering::SeqCst),
        "dropped after the last piece"
    );
    assert_eq!(mr_count(&p), base);
}

/// Reads `/proc/sys/vm/nr_hugepages` and restores it when dropped.
struct HugePages(String);

impl HugePages {
    fn set(n: u64) -> HugePages {
        let old = std::fs::read_to_string(NR).expect("this kernel has hugetlbfs");
        std::fs::write(NR, n.to_string()).unwrap();
        HugePages(old)
    }
}

const NR: &str = "/proc/sys/vm/nr_hugepages";
const FREE_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR, self.0.trim());
    }
}

fn free_2m() -> u64 {
    std::fs::read_to_string(FREE_2M)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn huge_pages_are_refused_with_the_way_to_reserve_them() {
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let _h = HugePages::set(0);
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let e = Mr::new_huge(&p.pd, 4 << 20, access, HugePageSize::Size2M).unwrap_err();
    assert!(
        matches!(
            e,
            Error::HugePagesUnavailable {
                len: 0x40_0000,
                page_size: 0x20_0000,
                pages: 2,
                free: 0,
                total: 0,
            }
        ),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("echo 2 > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"),
        "{msg}"
    );
    // 1 GiB pages: none reserved (or none at all) in the guest.
    assert!(matches!(
        AnonMemory::huge(1, HugePageSize::Size1G),
        Err(Error::HugePagesUnavailable {
            page_size: 0x4000_0000,
            pages: 1,
            ..
        })
    ));
    // The explicit fallback gets ordinary pages.
    let m = AnonMemory::huge_or_base(4 << 20, HugePageSize::Size2M).unwrap();
    assert_eq!(m.huge_pages(), None);
}

#[test]
fn huge_pages_register_and_take_a_write() {
    let _g = serial();
    let mut p = pair(caps_sr(8, 8));
    let _h = HugePages::set(4);
    assert_eq!(free_2m(), 4);
    let len = (4 << 20) - 100;
    let mr = Mr::new_huge(&p.pd, len, all_remote(), HugePageSize::Size2M).unwrap();
    assert_eq!(free_2m(), 2, "two huge pages in use");
    assert_eq!((mr.addr() % (2 << 20), mr.len()), (0, len));
    write_into(&mut p, &mr, &pattern(len, 4));
    let m: AnonMemory = mr.into_buffer().unwrap();
    assert_eq!(m.huge_pages(), Some(HugePageSize::Size2M));
    assert_eq!(&m[..], &pattern(len, 4)[..]);
    drop(m);
    assert_eq!(free_2m(), 4, "unmapped");
}

#[cfg(feature = "memmap2")]
mod mapped_files {
    use super::*;
    use memmap2::{Mmap, MmapMut, MmapOptions};
    use std::fs::{File, OpenOptions};
    use std::path::PathBuf;

    /// A file of `data` under the temporary directory, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, data: &[u8]) -> TempFile {
            let path = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
            std::fs::write(&path, data).unwrap();
            TempFile(path)
        }

        fn open_rw(&self) -> File {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.0)
                .unwrap()
        }

        fn map_ro(&self) -> Mmap {
            // SAFETY: the test's own file; nothing else modifies it meanwhile.
            unsafe { Mmap::map(&File::open(&self.0).unwrap()) }.unwrap()
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn a_writable_file_mapping_takes_a_write_that_reaches_the_file() {
        let _g = serial();
        let mut p = pair(caps_sr(8, 8));
        let len = 2 * 4096 + 300;
        let f = TempFile::new("owned-mr-rw", &vec![0u8; len]);
        // SAFETY: the test's own file; nothing else modifies it meanwhile.
        let map = unsafe { MmapMut::map_mut(&f.open_rw()) }.unwrap();
        let addr = map.as_ptr() as u64;
        let mr = Mr::register(&p.pd, map, all_remote()).unwrap();
        assert_eq!((mr.addr(), mr.len()), (addr, len));
        write_into(&mut p, &mr, &pattern(len, 11));
        let map: MmapMut = mr.into_buffer().unwrap();
        map.flush().unwrap();
        drop(map);
        assert_eq!(std::fs::read(&f.0).unwrap(), pattern(len, 11));
    }

    #[test]
    fn a_read_only_mapping_is_refused_write_access_and_read_by_a_peer() {
        let _g = serial();
        let mut p = pair(caps_sr(8, 8));
        let base = mr_count(&p);
        let data = pattern(3 * 4096, 12);
        let f = TempFile::new("owned-mr-ro", &data);
        for access in [
            AccessFlags::LOCAL_WRITE,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
            AccessFlags::REMOTE_READ | AccessFlags::MW_BIND,
        ] {
            let e = Mr::register(&p.pd, f.map_ro(), access).unwrap_err();
            assert!(matches!(e, Error::ReadOnlyMemory { .. }), "{access:?}: {e}");
            assert!(e.to_string().contains("REMOTE_READ"), "{e}");
        }
        assert_eq!(mr_count(&p), base, "nothing registered");
        // A shared read-only mapping: kernels before 6.2 pin every
        // registration for writing (FOLL_FORCE), which it refuses; later
        // ones pin it for reading.
        match Mr::register(&p.pd, f.map_ro(), AccessFlags::REMOTE_READ) {
            Ok(_mr) => assert!(
                common::kernel_version() >= (6, 2),
                "{:?}",
                common::kernel_version()
            ),
            Err(e) => {
                assert!(
                    common::kernel_version() < (6, 2),
                    "{:?}: {e}",
                    common::kernel_version()
                );
                assert!(
                    matches!(
                        e,
                        Error::Verb {
                            verb: "ibv_reg_mr",
                            ..
                        }
                    ),
                    "{e}"
                );
                assert_eq!(e.errno(), Some(libc::EFAULT));
                assert!(e.to_string().contains("map_copy_read_only"), "{e}");
            }
        }
        assert_eq!(mr_count(&p), base, "nothing registered");
        // A private read-only mapping registers on every kernel.
        // SAFETY: the test's own file; nothing else modifies it meanwhile.
        let map = unsafe { MmapOptions::new().map_copy_read_only(&File::open(&f.0).unwrap()) };
        let mut mr = Mr::register(&p.pd, map.unwrap(), AccessFlags::REMOTE_READ).unwrap();
        assert_eq!(mr.as_slice().unwrap(), &data[..]);
        assert!(matches!(
            mr.write_at(0, &[1]),
            Err(Error::ReadOnlyMemory { op: "Mr::write_at" })
        ));
        assert!(matches!(
            mr.as_mut_slice(),
            Err(Error::ReadOnlyMemory { .. })
        ));
        assert!(matches!(mr.fill(0), Err(Error::ReadOnlyMemory { .. })));
        assert_eq!(read_from(&mut p, &mr), data, "a peer READs the mapping");
        let map: Mmap = mr.into_buffer().unwrap();
        assert_eq!(&map[..], &data[..]);
        drop(map);
        assert_eq!(mr_count(&p), base);
    }

    #[test]
    fn a_truncated_file_mapping_keeps_its_pinned_pages_for_the_nic() {
        let _g = serial();
        let mut p = pair(caps_sr(8, 8));
        let data = pattern(2 * 4096, 13);
        let f = TempFile::new("owned-mr-trunc", &data);
        // SAFETY: the test's own file, truncated below only while the CPU
        // does not touch the mapping (the hazard this test shows).
        let map = unsafe { MmapMut::map_mut(&f.open_rw()) }.unwrap();
        let mr = Mr::register(&p.pd, map, all_remote()).unwrap();
        f.open_rw().set_len(0).unwrap();
        // The registration pinned the pages: the NIC still reads and writes
        // them, though they no longer belong to the file.
        assert_eq!(read_from(&mut p, &mr), data);
        write_into(&mut p, &mr, &pattern(2 * 4096, 14));
        assert_eq!(read_from(&mut p, &mr), pattern(2 * 4096, 14));
        assert_eq!(std::fs::metadata(&f.0).unwrap().len(), 0, "not the file's");
        // Not read back by the CPU: that is SIGBUS past the end of the file.
        // Dropping unmaps without touching the bytes.
        drop(mr);
    }
}

/// A field of `/proc/self/status` or `/proc/meminfo`, in its unit (kB or pages).
fn proc_field(file: &str, name: &str) -> u64 {
    let text = std::fs::read_to_string(file).unwrap();
    let line = text.lines().find(|l| l.starts_with(name)).unwrap();
    line[name.len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Registration time and pinned memory on 4 KiB against 2 MiB pages, for
/// docs/performance.md: `--ignored --nocapture measure_registration`.
#[test]
#[ignore = "a measurement; prints figures"]
fn measure_registration() {
    use std::time::Instant;
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let avail_kb = proc_field("/proc/meminfo", "MemAvailable:");
    // One kind at a time (huge pages reserved only for their rounds): at most 1 GiB.
    let len = ((avail_kb * 1024 * 3 / 5) as usize).min(1 << 30) & !((2 << 20) - 1);
    println!("MemAvailable {avail_kb} kB; registering {} MiB", len >> 20);
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    for round in 0..5 {
        for huge in [false, true] {
            let _h = huge.then(|| HugePages::set((len / (2 << 20)) as u64));
            let m = if huge {
                AnonMemory::huge(len, HugePageSize::Size2M).unwrap()
            } else {
                AnonMemory::new(len).unwrap()
            };
            let pin0 = proc_field("/proc/self/status", "VmPin:");
            let t = Instant::now();
            let mr = Mr::register(&p.pd, m, access).unwrap();
            let reg = t.elapsed();
            let pin = proc_field("/proc/self/status", "VmPin:") - pin0;
            let t = Instant::now();
            let m: AnonMemory = mr.into_buffer().unwrap();
            let dereg = t.elapsed();
            println!(
                "MEASURE round {round} pages {} reg_ms {:.1} dereg_ms {:.1} vmpin_kb {pin} \
                 huge_pages_in_use {}",
                if huge { "2M" } else { "4K" },
                reg.as_secs_f64() * 1e3,
                dereg.as_secs_f64() * 1e3,
                if huge {
                    (len / (2 << 20)) as u64 - free_2m()
                } else {
                    0
                },
            );
            drop(m);
        }
    }
}

//! Memory registration on real soft-RoCE: sizes, access flags, memlock.

mod common;

use std::process::Command;

use common::ctx;
use rdma_verbs::Error;
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;

fn combos() -> Vec<AccessFlags> {
    let bits = [
        AccessFlags::LOCAL_WRITE,
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_READ,
        AccessFlags::REMOTE_ATOMIC,
    ];
    (0..16u32)
        .map(|m| {
            bits.iter()
                .enumerate()
                .filter(|(i, _)| m & (1 << i) != 0)
                .fold(AccessFlags::empty(), |a, (_, b)| a | *b)
        })
        .collect()
}

/// REMOTE_WRITE and REMOTE_ATOMIC require LOCAL_WRITE (ibv_reg_mr(3)).
fn valid(a: AccessFlags) -> bool {
    !a.remotely_writable() || a.contains(AccessFlags::LOCAL_WRITE)
}

#[test]
fn register_each_size_with_each_access_combination() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    for len in [1usize, 4096, 64 << 20] {
        for access in combos() {
            match pd.alloc_mr(len, access) {
                Ok(mut mr) => {
                    assert!(valid(access), "{access:?} should have been refused");
                    assert_eq!(mr.len(), len);
                    assert_ne!(mr.lkey(), 0);
                    // rxe hands out an rkey only when some remote access is granted.
                    let remote = AccessFlags::REMOTE_WRITE
                        | AccessFlags::REMOTE_READ
                        | AccessFlags::REMOTE_ATOMIC;
                    if access.intersects(remote) {
                        assert_ne!(mr.rkey(), 0, "{access:?}");
                    }
                    assert_eq!(mr.access(), access);
                    // SAFETY: reading plain fields of a live ibv_mr.
                    let (length, addr) =
                        unsafe { ((*mr.as_raw()).length, (*mr.as_raw()).addr as u64) };
                    assert_eq!(length, len);
                    assert_eq!(addr, mr.addr());
                    assert_eq!(mr.addr() % 4096, 0, "page aligned");
                    mr.write_at(len - 1, &[0xab]).unwrap();
                    let mut b = [0u8];
                    mr.read_at(len - 1, &mut b).unwrap();
                    assert_eq!(b[0], 0xab);
                    if access.remotely_writable() {
                        assert!(matches!(mr.as_slice(), Err(Error::RemotelyWritable)));
                    } else {
                        assert_eq!(mr.as_slice().unwrap()[len - 1], 0xab);
                    }
                }
                Err(e) => {
                    // Refused locally, naming the rule (the kernel only says EINVAL).
                    assert!(!valid(access), "{access:?} at {len} bytes: {e}");
                    assert!(
                        matches!(
                            e,
                            Error::InvalidArgument {
                                what: "MR access flags",
                                ..
                            }
                        ),
                        "{e}"
                    );
                    assert!(e.to_string().contains("need LOCAL_WRITE"), "{e}");
                }
            }
        }
    }
}

#[test]
fn zero_length_is_a_typed_error() {
    let pd = Pd::new(&ctx()).unwrap();
    assert!(matches!(
        pd.alloc_mr(0, AccessFlags::LOCAL_WRITE),
        Err(Error::InvalidArgument {
            what: "MR length",
            ..
        })
    ));
}

#[test]
fn split_and_unsplit_share_one_registration() {
    let pd = Pd::new(&ctx()).unwrap();
    let mut a = pd.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
    let lkey = a.lkey();
    let mut b = a.split_off(40).unwrap();
    assert_eq!((a.len(), b.len()), (40, 60));
    assert_eq!(b.addr(), a.addr() + 40);
    assert_eq!(b.lkey(), lkey);
    b.as_mut_slice().unwrap().fill(7);
    assert!(a.as_slice().unwrap().iter().all(|&x| x == 0));
    let other = pd.alloc_mr(10, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(a.unsplit(other).is_err(), "not adjacent");
    a.unsplit(b).unwrap();
    assert_eq!(a.len(), 100);
    assert_eq!(a.as_slice().unwrap()[40..], [7; 60]);
    assert!(a.split_off(101).is_err());
}

/// Runs only as the unprivileged child of `memlock_limit_gives_the_memlock_error`.
#[test]
#[ignore = "child process of memlock_limit_gives_the_memlock_error"]
fn memlock_child() {
    let pd = Pd::new(&ctx()).unwrap();
    let small = pd.alloc_mr(4 << 20, AccessFlags::LOCAL_WRITE);
    assert!(
        small.is_ok(),
        "4 MiB under an 8 MiB limit: {:?}",
        small.err()
    );
    match pd.alloc_mr(9 << 20, AccessFlags::LOCAL_WRITE) {
        Err(e @ Error::MemlockLimit { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("ulimit -l"), "{msg}");
            assert!(msg.contains("8388608 bytes"), "{msg}");
            println!("MEMLOCK-ERROR-OK: {msg}");
        }
        other => panic!("expected MemlockLimit, got {other:?}"),
    }
}

#[test]
fn memlock_limit_gives_the_memlock_error() {
    // Root has CAP_IPC_LOCK and is never limited: re-run this binary's child
    // test as nobody with an 8 MiB RLIMIT_MEMLOCK.
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("prlimit")
        .arg("--memlock=8388608:8388608")
        .args([
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ])
        .arg(&exe)
        .args([
            "memlock_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("HOME", "/tmp")
        .output()
        .expect("run prlimit/setpriv");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("MEMLOCK-ERROR-OK"),
        "child did not reach the check:\n{stdout}\n{stderr}"
    );
}

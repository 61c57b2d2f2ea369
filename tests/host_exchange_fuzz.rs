//! A stable-toolchain stand-in for `fuzz/` (cargo-fuzz needs nightly): feeds
//! a few hundred thousand pseudo-random and mutated inputs to the exchange
//! parsers, bounded in time, checking the same properties as the fuzz target:
//! no panic, anything that parses re-encodes and re-parses to the same value,
//! and the stream readers agree with the slice parsers.
//!
//! The generator is a fixed-seed xorshift64*, so a failure reproduces; set
//! `EXCHANGE_FUZZ_SEED` to explore other sequences and `EXCHANGE_FUZZ_SECS`
//! to change the time budget (default 3 s).

use std::io::Cursor;
use std::time::{Duration, Instant};

use rdma_verbs::device::Gid;
use rdma_verbs::exchange::{
    self, ENDPOINT_MSG_LEN, MR_HEADER_LEN, MR_RECORD_LEN, PeerInfo, WireMessage, encode_endpoint,
    encode_peer_info, parse_endpoint, parse_mr_header, parse_mr_record, parse_peer_info,
};
use rdma_verbs::mr::RemoteMr;
use rdma_verbs::qp::Endpoint;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// Bytes a parser finds interesting.
const DICT: &[u8] = b"0123456789abcdefABCDEFxX:\0 -+\xff\n";

fn random_endpoint(r: &mut XorShift) -> Endpoint {
    let mut gid = [0u8; 16];
    for b in &mut gid {
        *b = r.byte();
    }
    Endpoint {
        lid: r.next() as u16,
        qpn: r.next() as u32 & 0xff_ffff,
        psn: r.next() as u32 & 0xff_ffff,
        gid: Gid(gid),
    }
}

fn random_info(r: &mut XorShift) -> PeerInfo {
    let n = [0, 1, 2, 3, 17][r.below(5)];
    PeerInfo {
        endpoint: random_endpoint(r),
        mrs: (0..n)
            .map(|_| {
                let addr = r.next() >> r.below(64);
                RemoteMr {
                    addr,
                    len: (r.next() >> r.below(64)).min(u64::MAX - addr),
                    rkey: r.next() as u32,
                }
            })
            .collect(),
    }
}

/// One test input: random bytes, or a valid message with mutations.
fn input(r: &mut XorShift) -> Vec<u8> {
    let mut v = match r.below(6) {
        0 => (0..r.below(160)).map(|_| r.byte()).collect(),
        1 => (0..r.below(80))
            .map(|_| DICT[r.below(DICT.len())])
            .collect(),
        2 | 3 => encode_endpoint(&random_endpoint(r)).unwrap().to_vec(),
        _ => encode_peer_info(&random_info(r)).unwrap(),
    };
    for _ in 0..r.below(4) {
        if v.is_empty() {
            break;
        }
        let i = r.below(v.len());
        match r.below(7) {
            0 => v[i] = r.byte(),
            1 => v[i] = DICT[r.below(DICT.len())],
            2 => v[i] ^= 1 << r.below(8),
            3 => v.truncate(i),
            4 => v.insert(i, DICT[r.below(DICT.len())]),
            5 => {
                v.remove(i);
            }
            _ => {
                let extra: Vec<u8> = (0..r.below(16)).map(|_| r.byte()).collect();
                v.extend(extra);
            }
        }
    }
    v
}

fn check(data: &[u8]) -> (bool, bool) {
    let ep = parse_endpoint(data);
    if let Ok(e) = &ep {
        assert!(
            e.qpn <= 0xff_ffff && e.psn <= 0xff_ffff,
            "{e:?} from {data:?}"
        );
        let wire = encode_endpoint(e).expect("a parsed endpoint re-encodes");
        assert_eq!(&parse_endpoint(&wire).unwrap(), e, "{data:?}");
    }
    let streamed = Endpoint::read_from(&mut Cursor::new(data));
    if data.len() >= ENDPOINT_MSG_LEN {
        assert_eq!(
            streamed.is_ok(),
            parse_endpoint(&data[..ENDPOINT_MSG_LEN]).is_ok(),
            "{data:?}"
        );
    } else {
        assert!(streamed.is_err());
    }
    let info = parse_peer_info(data);
    if let Ok(i) = &info {
        assert!(i.mrs.len() <= exchange::MAX_REMOTE_MRS);
        assert!(i.mrs.iter().all(|m| m.addr.checked_add(m.len).is_some()));
        let wire = encode_peer_info(i).expect("parsed peer info re-encodes");
        assert_eq!(&parse_peer_info(&wire).unwrap(), i, "{data:?}");
        let mut cur = Cursor::new(data);
        assert_eq!(&PeerInfo::read_from(&mut cur).unwrap(), i);
        assert_eq!(cur.position() as usize, data.len());
    } else if let Ok(i) = PeerInfo::read_from(&mut Cursor::new(data)) {
        // The stream reader stops after the message: only trailing bytes differ.
        assert!(data.len() > i.wire_len(), "{data:?}");
    }
    if data.len() >= MR_HEADER_LEN {
        let _ = parse_mr_header(&data[..MR_HEADER_LEN]);
    }
    if data.len() >= MR_RECORD_LEN {
        let _ = parse_mr_record(&data[..MR_RECORD_LEN]);
    }
    let _ = exchange::read_done(&mut Cursor::new(data));
    (ep.is_ok(), info.is_ok())
}

#[test]
fn parsers_survive_random_and_mutated_input() {
    let seed = std::env::var("EXCHANGE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9e37_79b9_7f4a_7c15u64);
    let budget = Duration::from_secs_f64(
        std::env::var("EXCHANGE_FUZZ_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3.0),
    );
    const MAX_INPUTS: u64 = 300_000;
    let mut r = XorShift(seed | 1);
    let start = Instant::now();
    let (mut n, mut ep_ok, mut info_ok) = (0u64, 0u64, 0u64);
    while n < MAX_INPUTS && start.elapsed() < budget {
        for _ in 0..256 {
            let data = input(&mut r);
            let (e, i) = check(&data);
            ep_ok += u64::from(e);
            info_ok += u64::from(i);
            n += 1;
        }
    }
    let took = start.elapsed();
    eprintln!(
        "exchange fuzz: {n} inputs in {took:.2?} (seed {seed:#x}): {ep_ok} parsed as endpoints, \
         {info_ok} as peer infos, the rest rejected"
    );
    assert!(n >= 10_000, "only {n} inputs in {took:?}");
    assert!(ep_ok > 0 && info_ok > 0 && ep_ok < n);
}

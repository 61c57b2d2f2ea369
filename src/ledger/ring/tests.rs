//! Unit tests of the ring: slots, retirement and sweeping without a device.

use super::*;
use crate::ffi;

const META: SlotMeta = SlotMeta {
    opcode: 0,
    signaled: true,
    drain: false,
};

fn post(ring: &Ring, head: &mut u64, wr_id: u64, signaled: bool) -> u64 {
    post_meta(ring, head, wr_id, SlotMeta { signaled, ..META })
}

fn post_meta(ring: &Ring, head: &mut u64, wr_id: u64, meta: SlotMeta) -> u64 {
    let bufs = Sges::default();
    let in_flight = ring.in_flight(*head);
    assert!(in_flight < ring.room_depth(in_flight), "the ring has room");
    // SAFETY: single producer, room checked (which allocated the slots);
    // `bufs` is forgotten after the move.
    let token = unsafe { ring.fill(*head, wr_id, meta, &bufs) };
    std::mem::forget(bufs);
    *head += 1;
    token
}

#[test]
fn slots_come_with_the_first_post_and_none_are_found_before() {
    let ring = Ring::new(4, 1, 7);
    assert!(ring.slots.load(Ordering::Relaxed).is_null());
    assert_eq!((ring.posting_depth(), ring.depth()), (0, 4));
    let mut lost = 0;
    assert_eq!(
        retire(&ring, ring.token(0), &mut lost),
        None,
        "no slot, stale"
    );
    // SAFETY: nothing was posted, so there is no producer to contradict.
    unsafe { ring.release_posted(0) };
    ring.release_all();
    let mut head = 0;
    let t = post(&ring, &mut head, 5, true);
    assert!(!ring.slots.load(Ordering::Relaxed).is_null());
    assert_eq!(ring.posting_depth(), 4);
    assert_eq!((retire(&ring, t, &mut lost), lost), (Some(5), 0));
    // Depth 0 (receives taken by an SRQ): no room, and no slots for it.
    let none = Ring::new(0, 2, 7);
    assert_eq!(none.room_depth(0), 0);
    assert!(none.slots.load(Ordering::Relaxed).is_null());
}

fn retire(ring: &Ring, token: u64, lost: &mut u64) -> Option<u64> {
    let mut out = MaybeUninit::<Sges>::uninit();
    let mut caught = None;
    // SAFETY: single consumer; `out` is written iff Some is returned.
    let r = unsafe {
        ring.retire(
            token as u32,
            &mut Release,
            out.as_mut_ptr(),
            &mut caught,
            lost,
        )
    };
    r.map(|r| {
        // SAFETY: written by retire.
        drop(unsafe { out.assume_init() });
        r.wr_id
    })
}

#[test]
fn a_staged_request_names_its_opcode_until_taken_back() {
    let ring = Ring::new(4, 1, 7);
    let mut head = 0;
    post(&ring, &mut head, 1, true);
    // SAFETY: single producer; the slot was filled above and never posted.
    unsafe {
        assert_eq!(ring.staged(0), Some((META.opcode, true)));
        assert_eq!(ring.staged(1), None, "never filled");
        assert_eq!(ring.unfill_from(0, &mut head).len(), 1);
        assert_eq!(ring.staged(0), None, "taken back");
    }
}

#[test]
fn tokens_validate_sequence_and_window() {
    let ring = Ring::new(3, 0x0102_0304, 7);
    let mut head = 0;
    let t0 = post(&ring, &mut head, 10, false);
    let t1 = post(&ring, &mut head, 11, true);
    assert_eq!(t0 >> 32, 0x0102_0304);
    let mut lost = 0;
    // Not posted yet / outside the window: refused, nothing changes.
    assert_eq!(retire(&ring, t1 + 1, &mut lost), None);
    assert_eq!(retire(&ring, t1 + 5, &mut lost), None);
    assert_eq!(ring.in_flight(head), 2);
    // t1 retires t0 (unsignaled) on the way.
    assert_eq!(retire(&ring, t1, &mut lost), Some(11));
    assert_eq!(lost, 0);
    assert_eq!(ring.in_flight(head), 0);
    // A repeat of t1 (stale) or t0 is refused.
    assert_eq!(retire(&ring, t1, &mut lost), None);
    assert_eq!(retire(&ring, t0, &mut lost), None);
}

#[test]
fn sweeping_a_signaled_request_counts_it_lost() {
    let ring = Ring::new(4, 1, 7);
    let mut head = 0;
    post(&ring, &mut head, 1, true);
    let t = post(&ring, &mut head, 2, true);
    let mut lost = 0;
    assert_eq!(retire(&ring, t, &mut lost), Some(2));
    assert_eq!(lost, 1);
}

/// Posts `(opcode, signaled)` requests with wr_ids 0.. on `ring`; returns their tokens.
fn post_ops(ring: &Ring, head: &mut u64, ops: &[(u32, bool)]) -> Vec<u64> {
    ops.iter()
        .map(|&(opcode, signaled)| {
            let meta = SlotMeta {
                opcode,
                signaled,
                drain: false,
            };
            post_meta(ring, head, *head, meta)
        })
        .collect()
}

fn held(ring: &Ring) -> usize {
    ring.held.lock().unwrap().len()
}

#[test]
fn an_out_of_order_ring_leaves_a_signaled_read_in_flight_and_holds_an_unsignaled_one() {
    use ffi::{IBV_WR_RDMA_READ as READ, IBV_WR_RDMA_WRITE as WRITE, IBV_WR_SEND as SEND};
    // An unsignaled WRITE and READ, a signaled READ, then a SEND that completes first.
    let ops = [(WRITE, false), (READ, false), (READ, true), (SEND, true)];
    for out_of_order in [false, true] {
        let mut ring = Ring::new(8, 1, 7);
        if out_of_order {
            ring = ring.completing_out_of_order();
        }
        let mut head = 0;
        let t = post_ops(&ring, &mut head, &ops);
        let mut lost = 0;
        assert_eq!(retire(&ring, t[3], &mut lost), Some(3));
        if !out_of_order {
            // In order: all four are done, the signaled READ's completion lost.
            assert_eq!((lost, held(&ring), ring.in_flight(head)), (1, 0, 0));
            continue;
        }
        // The WRITE retired, the unsignaled READ held, the signaled one in flight
        // and keeping the tail (and the window) at its slot.
        assert_eq!((lost, held(&ring), ring.tail()), (0, 1, 2));
        assert_eq!(ring.in_flight(head), 2);
        assert_eq!(
            retire(&ring, t[3], &mut lost),
            None,
            "the SEND is stale now"
        );
        // The READ's own completion retires it and moves the tail past the SEND.
        assert_eq!(retire(&ring, t[2], &mut lost), Some(2));
        assert_eq!((lost, ring.tail(), ring.in_flight(head)), (0, 4, 0));
    }
}

#[test]
fn an_any_order_ring_leaves_every_earlier_signaled_send_in_flight() {
    use ffi::IBV_WR_SEND as SEND;
    let ring = Ring::new(8, 1, 7).completing_in_any_order();
    let mut head = 0;
    // Three signaled SENDs and an unsignaled one; the third completes first.
    let ops = [(SEND, true), (SEND, false), (SEND, true), (SEND, true)];
    let t = post_ops(&ring, &mut head, &ops);
    let mut lost = 0;
    assert_eq!(retire(&ring, t[2], &mut lost), Some(2));
    // Nothing lost; the first SEND keeps the tail, the unsignaled one is held.
    assert_eq!((lost, held(&ring), ring.tail()), (0, 1, 0));
    assert_eq!(retire(&ring, t[3], &mut lost), Some(3));
    assert_eq!(retire(&ring, t[0], &mut lost), Some(0));
    assert_eq!((lost, ring.tail(), ring.in_flight(head)), (0, 4, 0));
}

#[test]
fn an_out_of_order_ring_retires_reads_and_sends_interleaved() {
    use ffi::{IBV_WR_RDMA_READ as READ, IBV_WR_SEND as SEND};
    let ring = Ring::new(8, 1, 7).completing_out_of_order();
    let mut head = 0;
    // READ 0, SEND 1 (unsignaled), READ 2, SEND 3, SEND 4.
    let ops = [
        (READ, true),
        (SEND, false),
        (READ, true),
        (SEND, true),
        (SEND, true),
    ];
    let t = post_ops(&ring, &mut head, &ops);
    let mut lost = 0;
    assert_eq!(
        retire(&ring, t[3], &mut lost),
        Some(3),
        "retires SEND 1 with it"
    );
    assert_eq!(ring.tail(), 0);
    // The second READ completes before the first: the tail stays at the first.
    assert_eq!(retire(&ring, t[2], &mut lost), Some(2));
    assert_eq!(ring.tail(), 0);
    // A full window: five in flight as far as the producer sees.
    assert_eq!(ring.in_flight(head), 5);
    assert_eq!(retire(&ring, t[0], &mut lost), Some(0));
    assert_eq!(
        ring.tail(),
        4,
        "past SEND 1, READ 2 and SEND 3, up to SEND 4"
    );
    assert_eq!(retire(&ring, t[4], &mut lost), Some(4));
    assert_eq!((ring.tail(), lost, held(&ring)), (5, 0, 0));
    // The slots are reused after the wrap of the window.
    let t = post_ops(&ring, &mut head, &[(SEND, true); 8]);
    assert_eq!(retire(&ring, t[7], &mut lost), Some(12));
    assert_eq!(
        (ring.tail(), lost),
        (13, 7),
        "the seven before it swept as lost"
    );
}

#[test]
fn wraps_past_u32_sequence_numbers() {
    let ring = Ring::new(2, 1, 7);
    ring.tail.store(u64::from(u32::MAX) - 1, Ordering::Relaxed);
    let mut head = u64::from(u32::MAX) - 1;
    let mut lost = 0;
    for i in 0..6 {
        let t = post(&ring, &mut head, i, true);
        assert_eq!(retire(&ring, t, &mut lost), Some(i));
    }
    assert_eq!(lost, 0);
}

#[test]
fn posted_opcodes_map_to_completion_opcodes() {
    use crate::ffi;
    let wc = |opcode| SlotMeta { opcode, ..META }.completion_opcode();
    assert_eq!(wc(ffi::IBV_WR_SEND), ffi::IBV_WC_SEND);
    assert_eq!(wc(ffi::IBV_WR_SEND_WITH_IMM), ffi::IBV_WC_SEND);
    assert_eq!(wc(ffi::IBV_WR_RDMA_WRITE), ffi::IBV_WC_RDMA_WRITE);
    assert_eq!(wc(ffi::IBV_WR_RDMA_WRITE_WITH_IMM), ffi::IBV_WC_RDMA_WRITE);
    assert_eq!(wc(ffi::IBV_WR_RDMA_READ), ffi::IBV_WC_RDMA_READ);
    assert_eq!(wc(ffi::IBV_WR_ATOMIC_CMP_AND_SWP), ffi::IBV_WC_COMP_SWAP);
    assert_eq!(wc(ffi::IBV_WR_ATOMIC_FETCH_AND_ADD), ffi::IBV_WC_FETCH_ADD);
    assert_eq!(wc(ffi::IBV_WR_ATOMIC_WRITE), ffi::IBV_WC_ATOMIC_WRITE);
    assert_eq!(wc(ffi::IBV_WR_FLUSH), ffi::IBV_WC_FLUSH);
    assert_eq!(wc(ffi::IBV_WR_LOCAL_INV), ffi::IBV_WC_LOCAL_INV);
    assert_eq!(wc(ffi::IBV_WR_BIND_MW), ffi::IBV_WC_BIND_MW);
    assert_eq!(wc(ffi::IBV_WR_SEND_WITH_INV), ffi::IBV_WC_SEND);
    assert_eq!(wc(ffi::IBV_WC_RECV), ffi::IBV_WC_RECV);
    assert!(
        SlotMeta {
            opcode: ffi::IBV_WC_RECV,
            ..META
        }
        .is_recv()
    );
    assert!(
        !SlotMeta {
            opcode: ffi::IBV_WR_SEND,
            ..META
        }
        .is_recv()
    );
}

#[test]
fn release_posted_takes_what_is_between_tail_and_head() {
    let ring = Ring::new(4, 1, 7);
    let mut head = 0;
    let mut lost = 0;
    // Wrap the ring once so that `tail..head` straddles its end.
    for i in 0..3 {
        let t = post(&ring, &mut head, i, true);
        assert_eq!(retire(&ring, t, &mut lost), Some(i));
    }
    let posted: Vec<u64> = (10..13).map(|i| post(&ring, &mut head, i, true)).collect();
    // SAFETY: the test is the producer and posts nothing more.
    unsafe { ring.release_posted(head) };
    for t in posted {
        assert_eq!(retire(&ring, t, &mut lost), None, "released");
    }
    assert!((0..4).all(|i| ring.slot(i).unwrap().state.load(Ordering::Relaxed) == EMPTY));
    assert_eq!(lost, 0);
}

#[test]
fn release_all_empties_posted_slots_once() {
    let ring = Ring::new(4, 1, 7);
    let mut head = 0;
    let t = post(&ring, &mut head, 1, true);
    ring.release_all();
    let mut lost = 0;
    assert_eq!(retire(&ring, t, &mut lost), None);
}

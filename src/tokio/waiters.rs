//! [`Waiters`]: a CQ's awaited requests, in a slab indexed by their `wr_id`.
//!
//! An awaited request's `wr_id` is its QP's request number above
//! [`SLOT_BITS`] and its slot here below them, so that a completion finds its
//! future's slot without a search; the slot holds the request's whole key
//! (QP number, queue, `wr_id`), and a completion is parked there only if the
//! key is its own. Its completion is parked in place: the driver moves it in
//! once, the future's poll moves it out once.

use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::task::Waker;

use crate::cq::{Completion, CompletionSource, WcOpcode};

/// Which queue a completion came from: sends and receives of one QP are
/// waited for separately, so a receive can never satisfy a send's waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Queue {
    Send,
    Recv,
}

impl Queue {
    fn of(c: &Completion) -> Queue {
        match c.opcode {
            WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => Queue::Recv,
            _ => Queue::Send,
        }
    }
}

/// A posted request's identity on its CQ: QP number, queue, `wr_id`.
pub(crate) type Key = (u32, Queue, u64);

/// Bits of an awaited request's `wr_id` that name its slot; the bits above
/// them are the QP's request number, so that a QP's `wr_id`s stay distinct
/// (and increasing) however slots are reused.
pub(crate) const SLOT_BITS: u32 = 24;

/// The slot part of a `wr_id`; this value itself names no slot (requests
/// nobody awaits carry it).
pub(crate) const NO_SLOT: u64 = (1 << SLOT_BITS) - 1;

/// The `wr_id` of the QP's request number `seq` in slot `slot`.
pub(crate) fn wr_id(seq: u64, slot: u64) -> u64 {
    (seq << SLOT_BITS) | slot
}

fn slot_of(wr_id: u64) -> usize {
    (wr_id & NO_SLOT) as usize
}

/// Where a slot's request stands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// No request (the slot is listed in [`Waiters::free`]).
    Free,
    /// Posted, not completed.
    Pending,
    /// Completed: its completion is in [`Entry::done`].
    Done,
}

/// A slot: the key of the request it holds, checked against every completion
/// that names the slot.
struct Entry {
    key: Key,
    stage: Stage,
    /// The waker of the task that awaits a pending request.
    waker: Option<Waker>,
    /// Initialised exactly while `stage` is `Done`: a completion is written
    /// here once and read out once, never moved as part of the slot.
    done: MaybeUninit<Completion>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        if self.stage == Stage::Done {
            // SAFETY: `done` is initialised while the stage is `Done`, and
            // is not read again (the entry is going).
            unsafe { self.done.assume_init_drop() };
        }
    }
}

/// What [`Waiters::take`] found for a key.
// The completion by value: boxing it would allocate per message, and it is
// moved once, into the future's output.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Taken {
    /// Its completion, the slot freed.
    Done(Completion),
    /// Still pending; the waker given is registered. Carries the waker it
    /// replaced, for the caller to drop once the CQ's lock is released (a
    /// waker's drop may run an executor's code, which may take it again).
    Pending(Option<Waker>),
    /// No slot holds this request.
    Unknown,
}

/// A CQ's awaited requests (see the module's docs).
#[derive(Default)]
pub(crate) struct Waiters {
    slots: Vec<Entry>,
    /// The free slots, reused last freed first.
    free: Vec<usize>,
}

impl Waiters {
    /// Takes a slot for request number `seq` of QP `qp_num`'s `queue`,
    /// pending with `waker`; returns its key. `None` with every slot taken.
    pub(crate) fn register(
        &mut self,
        qp_num: u32,
        queue: Queue,
        seq: u64,
        waker: Waker,
    ) -> Option<Key> {
        let slot = match self.free.pop() {
            Some(i) => i,
            None if (self.slots.len() as u64) < NO_SLOT => {
                self.slots.push(Entry {
                    key: (0, Queue::Send, NO_SLOT),
                    stage: Stage::Free,
                    waker: None,
                    done: MaybeUninit::uninit(),
                });
                self.slots.len() - 1
            }
            None => return None,
        };
        let key = (qp_num, queue, wr_id(seq, slot as u64));
        let e = &mut self.slots[slot];
        e.key = key;
        e.stage = Stage::Pending;
        e.waker = Some(waker);
        Some(key)
    }

    /// Whether no slot is taken: no request awaits its completion.
    pub(crate) fn is_idle(&self) -> bool {
        self.free.len() == self.slots.len()
    }

    /// Parks each completion of `done` in the slot of the pending request
    /// it completes, adding that request's waker to `wake`, or else appends
    /// it to `unclaimed`; `done` is empty on return. Each completion is
    /// moved once, from `done` to where it goes.
    pub(crate) fn park_all(
        &mut self,
        done: &mut Vec<Completion>,
        wake: &mut Vec<Waker>,
        unclaimed: &mut VecDeque<Completion>,
    ) {
        let n = done.len();
        // SAFETY: the first `n` elements are initialised; with the length
        // at 0 the vector no longer owns them, and each is read exactly once
        // below (a panic in between leaks the rest rather than dropping any
        // twice).
        unsafe { done.set_len(0) };
        let base = done.as_ptr();
        for i in 0..n {
            // SAFETY: `i < n`: an initialised element not yet read.
            let c = unsafe { &*base.add(i) };
            let e = self.slots.get_mut(slot_of(c.wr_id)).filter(|e| {
                e.stage == Stage::Pending && e.key == (c.qp_num, Queue::of(c), c.wr_id)
            });
            match e {
                Some(e) if c.source == CompletionSource::Posted => {
                    // SAFETY: read once (see above); `done` was uninitialised
                    // while the stage was `Pending`, and `Done` says it is
                    // initialised from here on.
                    unsafe { e.done.as_mut_ptr().copy_from_nonoverlapping(c, 1) };
                    e.stage = Stage::Done;
                    wake.extend(e.waker.take());
                }
                // SAFETY: read once (see above).
                _ => unclaimed.push_back(unsafe { std::ptr::read(c) }),
            }
        }
    }

    /// The completion of `key` if it has come (its slot freed); else
    /// `waker` is registered for it (when it is pending and `waker` is
    /// `Some`).
    #[inline]
    pub(crate) fn take(&mut self, key: Key, waker: Option<&Waker>) -> Taken {
        let slot = slot_of(key.2);
        let Some(e) = self.slots.get_mut(slot) else {
            return Taken::Unknown;
        };
        if e.key != key {
            return Taken::Unknown;
        }
        match e.stage {
            Stage::Free => Taken::Unknown,
            Stage::Pending => {
                let mut replaced = None;
                if let Some(w) = waker
                    && !e.waker.as_ref().is_some_and(|old| old.will_wake(w))
                {
                    replaced = e.waker.replace(w.clone());
                }
                Taken::Pending(replaced)
            }
            Stage::Done => {
                e.stage = Stage::Free;
                self.free.push(slot);
                // SAFETY: `done` was initialised when the stage became
                // `Done`; the stage is `Free` now, so it is read only here.
                Taken::Done(unsafe { e.done.assume_init_read() })
            }
        }
    }

    /// Frees `key`'s slot: its completion if it had come; a pending request
    /// loses its slot, so its completion will find none holding its key.
    /// The slot's waker comes back too, for the caller to drop once the
    /// CQ's lock is released (see [`Taken::Pending`]).
    pub(crate) fn release(&mut self, key: Key) -> (Option<Completion>, Option<Waker>) {
        let slot = slot_of(key.2);
        let Some(e) = self.slots.get_mut(slot) else {
            return (None, None);
        };
        if e.key != key || e.stage == Stage::Free {
            return (None, None);
        }
        let waker = e.waker.take();
        if e.stage == Stage::Pending {
            e.stage = Stage::Free;
            self.free.push(slot);
            return (None, waker);
        }
        match self.take(key, None) {
            Taken::Done(c) => (Some(c), waker),
            Taken::Pending(_) | Taken::Unknown => (None, waker),
        }
    }

    /// Frees the slot of every request of QP `qp_num` ([`release`](Self::release)),
    /// appending the completions that had come to `unclaimed`.
    pub(crate) fn release_qp(
        &mut self,
        qp_num: u32,
        unclaimed: &mut VecDeque<Completion>,
        stale: &mut Vec<Waker>,
    ) {
        for slot in 0..self.slots.len() {
            let key = self.slots[slot].key;
            if key.0 == qp_num && self.slots[slot].stage != Stage::Free {
                let (done, waker) = self.release(key);
                unclaimed.extend(done);
                stale.extend(waker);
            }
        }
    }

    /// The wakers of every pending request, taken.
    pub(crate) fn take_wakers(&mut self) -> impl Iterator<Item = Waker> + '_ {
        self.slots.iter_mut().filter_map(|e| e.waker.take())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop() -> Waker {
        Waker::noop().clone()
    }

    #[test]
    fn a_slot_is_reused_under_a_new_number_and_the_old_key_finds_nothing() {
        let mut w = Waiters::default();
        let a = w.register(7, Queue::Send, 1, noop()).unwrap();
        assert_eq!(a.2, wr_id(1, 0));
        assert!(w.release(a).0.is_none());
        let b = w.register(7, Queue::Send, 2, noop()).unwrap();
        assert_eq!(slot_of(b.2), 0);
        assert!(matches!(w.take(a, None), Taken::Unknown));
        assert!(matches!(w.take(b, None), Taken::Pending(None)));
        let c = w.register(7, Queue::Recv, 3, noop()).unwrap();
        assert_eq!(slot_of(c.2), 1);
    }

    #[test]
    fn releasing_a_qp_frees_its_slots_only() {
        let mut w = Waiters::default();
        let a = w.register(7, Queue::Send, 0, noop()).unwrap();
        let b = w.register(8, Queue::Send, 0, noop()).unwrap();
        let c = w.register(7, Queue::Recv, 1, noop()).unwrap();
        let (mut unclaimed, mut stale) = (VecDeque::new(), Vec::new());
        w.release_qp(7, &mut unclaimed, &mut stale);
        assert_eq!(stale.len(), 2, "the released requests' wakers come back");
        assert!(unclaimed.is_empty(), "nothing had completed");
        assert!(matches!(w.take(a, None), Taken::Unknown));
        assert!(matches!(w.take(c, None), Taken::Unknown));
        assert!(matches!(w.take(b, None), Taken::Pending(None)));
        assert_eq!(w.free.len(), 2);
    }
}

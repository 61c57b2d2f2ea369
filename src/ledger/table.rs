//! The rings a CQ carries completions for, and the CQ entries they reserve.
//!
//! Every queue (SQ or RQ) posting through the safe path registers its
//! [`Ring`] in the table of the CQ its completions go to. The ring's index in
//! the table (and a generation) is the high half of every `wr_id` token it
//! hands out, so the poller finds the ring by index, never by trusting a
//! pointer from the completion.
//!
//! The table also keeps the books of the CQ's capacity: a queue of depth `d`
//! can have at most `d` completions in the CQ at once (one per posted request,
//! signaled or flushed), so registering it *reserves* `d` entries. A queue
//! that does not fit asks the CQ to grow (the caller's `grow`, which resizes
//! the CQ under the table's lock, so reservations and resizes are
//! serialised and the depth only changes together with the books), and is
//! refused only when the CQ cannot grow. A destroyed QP's rings stay registered (their
//! buffers already released) until a poll finds the CQ empty, because until
//! then completions naming them may still sit in the CQ; only then are their
//! entries given back. Their reservation goes with them, unless the queue was
//! drained when the QP was destroyed (nothing in flight, and never a raw
//! post, whose completions the ring does not count): then no completion of
//! it can be left in the CQ, and its entries are given back at once.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::ledger::ring::Ring;

/// Most rings one table can hold (indices fit the token's 23 bits).
const MAX_RINGS: usize = 1 << 23;

/// Set in every tag (bit 63 of every token): `wr_id`s of raw posts must have
/// it clear, so no raw `wr_id` can ever look like a token.
pub(crate) const TAG_FLAG: u32 = 1 << 31;

/// The table index in a tag.
#[inline(always)]
fn index_of(tag: u32) -> usize {
    ((tag & !TAG_FLAG) >> 8) as usize
}

/// The rings registered on one CQ; lives in the CQ.
pub(crate) struct RingTable {
    state: Mutex<TableState>,
    /// Bumped after every registration: the poller's cache is stale when it differs.
    version: AtomicU64,
    /// How many destroyed rings wait to be unregistered.
    destroyed: AtomicUsize,
    /// [`MAX_RINGS`] (smaller in tests).
    max_rings: usize,
}

struct TableState {
    /// Completions the CQ can hold.
    depth: u64,
    /// Completions the registered queues (and the reservations being made) may produce.
    reserved: u64,
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Indices of rings whose QP was destroyed, oldest first.
    destroyed: Vec<u32>,
    /// Indices promised to reservations not published (or dropped) yet.
    promised: usize,
}

#[derive(Default)]
struct Entry {
    ring: Option<Arc<Ring>>,
    /// Bumped each time the index is freed. Eight bits suffice because an
    /// index is freed only by `unregister_destroyed`, after a poll that found
    /// the CQ empty and counting only QPs destroyed before that poll began: no
    /// completion of an earlier holder is left to meet the new one, whatever
    /// the generation.
    generation: u8,
    /// The ring's reservation was given back when it was destroyed (drained).
    released: bool,
}

/// CQ entries set aside for one queue that is being created; given back when
/// dropped unless [`publish`](Reservation::publish)ed.
pub(crate) struct Reservation<'a> {
    table: &'a RingTable,
    n: u64,
}

impl RingTable {
    pub(crate) fn new(depth: u32) -> RingTable {
        RingTable {
            state: Mutex::new(TableState {
                depth: u64::from(depth),
                reserved: 0,
                entries: Vec::new(),
                free: Vec::new(),
                destroyed: Vec::new(),
                promised: 0,
            }),
            version: AtomicU64::new(0),
            destroyed: AtomicUsize::new(0),
            max_rings: MAX_RINGS,
        }
    }

    fn lock(&self) -> MutexGuard<'_, TableState> {
        // Nothing panics while the lock is held, but never propagate poison.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets aside room for `n` completions of a `queue` ("send"/"receive")
    /// queue, or explains why the CQ cannot take them.
    ///
    /// When the free entries are too few, `grow(want, depth)` is called with
    /// the table locked: `want` is the least depth that takes the queue,
    /// `depth` the current one. It returns the CQ's depth after resizing it
    /// (a provider that gave less than `want` makes the queue refused),
    /// `None` where the CQ cannot grow (then [`Error::CqTooSmall`]), or an
    /// error, which is returned as is.
    pub(crate) fn reserve(
        &self,
        n: u64,
        queue: &'static str,
        grow: impl FnOnce(u64, u64) -> Result<Option<u64>>,
    ) -> Result<Reservation<'_>> {
        let mut st = self.lock();
        // Every ring takes an index, including those that reserve no entry
        // (the receive queue of a QP on an SRQ): the index must fit the
        // token, or a ring's tag would alias another's.
        if st.entries.len() - st.free.len() + st.promised >= self.max_rings {
            return Err(Error::InvalidArgument {
                what: "CQ",
                reason: format!(
                    "it already carries the completions of {} queues, counting those of \
                     destroyed QPs until a poll finds the CQ empty; poll it empty or use another CQ",
                    self.max_rings
                ),
            });
        }
        let mut free = st.depth.saturating_sub(st.reserved);
        if n > free {
            let want = st.reserved.saturating_add(n);
            if let Some(depth) = grow(want, st.depth)? {
                // The depth the CQ has now, as the provider reports it.
                st.depth = depth;
                free = st.depth.saturating_sub(st.reserved);
            }
        }
        if n > free {
            return Err(Error::CqTooSmall {
                queue,
                needed: n,
                free,
                depth: st.depth,
            });
        }
        st.reserved += n;
        st.promised += 1;
        Ok(Reservation { table: self, n })
    }

    /// Registers a destroyed QP's ring for reaping (its buffers are already
    /// released); its completions may still be in the CQ. `drained`: none can
    /// be (nothing in flight, no raw posts), so its reservation is given back
    /// now.
    pub(crate) fn retire_destroyed(&self, ring: &Ring, drained: bool) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let index = index_of(ring.tag());
        if drained {
            if let Some(e) = st.entries.get_mut(index) {
                let same = e
                    .ring
                    .as_ref()
                    .is_some_and(|r| std::ptr::eq(Arc::as_ptr(r), ring));
                if same && !e.released {
                    e.released = true;
                    st.reserved -= ring.depth();
                }
            }
        }
        st.destroyed.push(index as u32);
        self.destroyed.store(st.destroyed.len(), Ordering::Release);
    }

    /// How many rings were destroyed so far (read before a poll that may unregister_destroyed them).
    #[inline]
    pub(crate) fn destroyed(&self) -> usize {
        self.destroyed.load(Ordering::Acquire)
    }

    /// Unregisters the first `n` destroyed rings: the CQ was polled empty after
    /// they were destroyed, so no completion can name them any more. Clears their
    /// entries in `cache` and returns them (to be dropped outside any lock).
    pub(crate) fn unregister_destroyed(&self, n: usize, cache: &mut RingCache) -> Vec<Arc<Ring>> {
        let mut st = self.lock();
        let n = n.min(st.destroyed.len());
        let indices: Vec<u32> = st.destroyed.drain(..n).collect();
        self.destroyed.store(st.destroyed.len(), Ordering::Release);
        let mut out = Vec::with_capacity(n);
        for i in indices {
            let e = &mut st.entries[i as usize];
            if let Some(ring) = e.ring.take() {
                e.generation = e.generation.wrapping_add(1);
                if !std::mem::take(&mut e.released) {
                    st.reserved -= ring.depth();
                }
                st.free.push(i);
                out.push(ring);
            }
            if let Some(p) = cache.rings.get_mut(i as usize) {
                *p = std::ptr::null();
            }
        }
        out
    }

    /// Completions the registered queues may still produce (for tests and `Debug`).
    pub(crate) fn reserved(&self) -> u64 {
        self.lock().reserved
    }

    /// Completions the CQ can hold.
    pub(crate) fn depth(&self) -> u64 {
        self.lock().depth
    }

    /// Sets the CQ's depth to what `resize(reserved)` returns, with the
    /// table locked so that no reservation runs in between: `reserved` is
    /// what the registered queues need, and `resize` refuses to go below it.
    pub(crate) fn resize(&self, resize: impl FnOnce(u64) -> Result<u64>) -> Result<u64> {
        let mut st = self.lock();
        let depth = resize(st.reserved)?;
        st.depth = depth;
        Ok(depth)
    }

    /// Gives up every ring without dropping it: the CQ could not be destroyed,
    /// so the NIC may still complete into buffers they hold.
    pub(crate) fn leak(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        std::mem::forget(std::mem::take(&mut st.entries));
    }
}

impl Reservation<'_> {
    /// Registers the ring `make(tag)` builds, keeping the reservation for its
    /// actual depth (at most what was reserved; the rest is given back).
    pub(crate) fn publish(self, make: impl FnOnce(u32) -> Ring) -> Arc<Ring> {
        let table = self.table;
        let reserved = self.n;
        std::mem::forget(self);
        let mut st = table.lock();
        st.promised -= 1;
        let index = match st.free.pop() {
            Some(i) => i as usize,
            None => {
                st.entries.push(Entry::default());
                st.entries.len() - 1
            }
        };
        // `reserve` promised an index below `max_rings`.
        debug_assert!(index < table.max_rings);
        let tag = TAG_FLAG | ((index as u32) << 8) | u32::from(st.entries[index].generation);
        let ring = Arc::new(make(tag));
        st.reserved -= reserved - ring.depth().min(reserved);
        st.entries[index].ring = Some(ring.clone());
        drop(st);
        table.version.fetch_add(1, Ordering::Release);
        ring
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut st = self.table.lock();
        st.reserved -= self.n;
        st.promised -= 1;
    }
}

/// The poller's lock-free copy of a table: ring pointers by index.
///
/// Lives in the [`Cq`](crate::cq::Cq) (single consumer). The rings it points to
/// are kept alive by the table until [`RingTable::unregister_destroyed`], which only the
/// poller calls and which clears the cache entries first.
#[derive(Default)]
pub(crate) struct RingCache {
    rings: Vec<*const Ring>,
    version: u64,
}

// SAFETY: the pointers are only dereferenced by the owner of the `Cq` (see
// above); the rings are Sync.
unsafe impl Send for RingCache {}
// SAFETY: shared references to the cache give no access to the rings.
unsafe impl Sync for RingCache {}

impl RingCache {
    /// The ring registered under `tag` (index and generation), if any.
    #[inline(always)]
    pub(crate) fn get(&mut self, table: &RingTable, tag: u32) -> Option<&Ring> {
        let index = index_of(tag);
        let p = match self.rings.get(index) {
            Some(p) if !p.is_null() => *p,
            _ => self.refresh(table, index)?,
        };
        // SAFETY: cached pointers are live (see the type's docs).
        let ring = unsafe { &*p };
        (ring.tag() == tag).then_some(ring)
    }

    /// Copies the table's registrations when they changed since the last copy.
    #[cold]
    #[inline(never)]
    fn refresh(&mut self, table: &RingTable, index: usize) -> Option<*const Ring> {
        let version = table.version.load(Ordering::Acquire);
        if version != self.version {
            let st = table.lock();
            self.rings.clear();
            self.rings.extend(
                st.entries
                    .iter()
                    .map(|e| e.ring.as_ref().map_or(std::ptr::null(), Arc::as_ptr)),
            );
            self.version = version;
        }
        self.rings.get(index).copied().filter(|p| !p.is_null())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CQ that cannot grow.
    fn no_growth(_: u64, _: u64) -> Result<Option<u64>> {
        Ok(None)
    }

    /// A queue that does not fit asks the CQ to grow by what it lacks; the
    /// new depth counts from then on, and a CQ that cannot grow refuses with
    /// the entries it has.
    #[test]
    fn a_queue_that_does_not_fit_grows_the_cq_or_is_refused() {
        let table = RingTable::new(16);
        let mut asked = Vec::new();
        let a = table
            .reserve(128, "send", |want, depth| {
                asked.push((want, depth));
                Ok(Some(want + 3))
            })
            .unwrap()
            .publish(|tag| Ring::new(128, tag, 7));
        assert_eq!(asked, [(128, 16)]);
        assert_eq!((table.depth(), table.reserved()), (131, 128));
        // Fits without growing: `grow` is not called.
        let b = table
            .reserve(3, "receive", |_, _| panic!("no growth needed"))
            .unwrap()
            .publish(|tag| Ring::new(3, tag, 7));
        let err = table.reserve(1, "receive", no_growth).err().unwrap();
        assert!(
            matches!(
                err,
                Error::CqTooSmall {
                    needed: 1,
                    free: 0,
                    depth: 131,
                    ..
                }
            ),
            "{err}"
        );
        let err = table
            .reserve(1, "receive", |_, _| {
                Err(Error::InvalidArgument {
                    what: "CQ",
                    reason: "refused".into(),
                })
            })
            .err()
            .unwrap();
        assert!(
            matches!(err, Error::InvalidArgument { what: "CQ", .. }),
            "{err}"
        );
        // A provider that grew the CQ by less than asked: the queue is
        // refused, and the books keep the depth the CQ has.
        let err = table
            .reserve(10, "send", |want, _| Ok(Some(want - 1)))
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                Error::CqTooSmall {
                    needed: 10,
                    free: 9,
                    depth: 140,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(table.depth(), 140);
        // A resize below what is reserved is the caller's to refuse; the
        // table takes what it returns.
        assert_eq!(table.resize(|reserved| Ok(reserved + 1)).unwrap(), 132);
        assert_eq!(table.depth(), 132);
        drop((a, b));
    }

    /// Rings that reserve no CQ entry (a QP on an SRQ) still take an index:
    /// past the limit the table refuses them instead of handing out a tag
    /// that aliases another ring's, and a unregistered index is used again.
    #[test]
    fn the_table_refuses_rings_past_its_index_limit() {
        let mut table = RingTable::new(8);
        table.max_rings = 3;
        let mut cache = RingCache::default();
        // A reservation dropped unpublished gives its index back.
        drop(table.reserve(0, "receive", no_growth).unwrap());
        let rings: Vec<Arc<Ring>> = (0..3)
            .map(|_| {
                table
                    .reserve(0, "receive", no_growth)
                    .unwrap()
                    .publish(|tag| Ring::new(0, tag, 7))
            })
            .collect();
        let mut tags: Vec<u32> = rings.iter().map(|r| r.tag()).collect();
        tags.sort_unstable();
        tags.dedup();
        assert_eq!(tags.len(), 3);
        let err = table
            .reserve(0, "receive", no_growth)
            .err()
            .expect("past the limit");
        assert!(
            matches!(err, Error::InvalidArgument { what: "CQ", .. }),
            "{err}"
        );
        table.retire_destroyed(&rings[1], false);
        assert!(
            table.reserve(0, "receive", no_growth).is_err(),
            "destroyed rings keep their index"
        );
        assert_eq!(table.unregister_destroyed(1, &mut cache).len(), 1);
        let again = table
            .reserve(0, "receive", no_growth)
            .unwrap()
            .publish(|tag| Ring::new(0, tag, 7));
        assert_eq!(index_of(again.tag()), index_of(rings[1].tag()));
        assert_ne!(again.tag(), rings[1].tag(), "a new generation");
    }

    /// A ring destroyed drained gives its reservation back at once and not again
    /// when unregistered; one destroyed with work in flight keeps it until the unregister_destroyed.
    #[test]
    fn a_drained_ring_gives_its_entries_back_when_buried() {
        let table = RingTable::new(64);
        let mut cache = RingCache::default();
        let ring = |n: u64| {
            table
                .reserve(n, "send", no_growth)
                .unwrap()
                .publish(|tag| Ring::new(n as u32, tag, 7))
        };
        let (a, b) = (ring(16), ring(8));
        assert_eq!(table.reserved(), 24);
        table.retire_destroyed(&a, true);
        assert_eq!(table.reserved(), 8);
        table.retire_destroyed(&b, false);
        assert_eq!(table.reserved(), 8);
        assert_eq!(table.unregister_destroyed(2, &mut cache).len(), 2);
        assert_eq!(table.reserved(), 0);
        // The freed indices take new rings with full reservations.
        let c = ring(32);
        assert_eq!(table.reserved(), 32);
        table.retire_destroyed(&c, false);
        assert_eq!(table.unregister_destroyed(1, &mut cache).len(), 1);
        assert_eq!(table.reserved(), 0);
    }
}

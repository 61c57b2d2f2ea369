//! rdma_cm multicast on UD ids (`rdma_join_multicast`, `rdma_leave_multicast`):
//! what `mckey` does.
//!
//! A UD id bound to a device (an address resolution of the group's address
//! from a local one, as `mckey -b` does, or a bind to a device's address)
//! joins a group by its IP address; the kernel answers with MULTICAST_JOIN,
//! whose UD parameters are the group's address vector, the remote QPN
//! [`MULTICAST_QPN`](crate::qp::MULTICAST_QPN) and the Q_Key to send with. On RoCE the join also makes
//! the interface a member of the IP group (IGMP), which the network and the
//! local loopback go by.
//!
//! librdmacm attaches the id's QP (`id->qp`) to the group when it reads
//! the JOIN event and detaches it on leave; this crate never leaves `id->qp`
//! set (see the [module docs](super)), so it attaches the QP itself
//! ([`Qp::attach_mcast`]) with the group the event names, and detaches it in
//! [`CmId::leave_multicast`]. The QP owns that attachment: its drop detaches
//! it, whether or not the group was left.

use super::ud::check_ud_qp;
use super::*;
use crate::ah::AddressHandle;
use crate::qp::{McastGroup, QpState, Ud};
use std::sync::Weak;

/// A group an id joined: its address, what its QP was attached to, that
/// QP's number (for messages) and its identity ([`Qp::mcast_owner`]), dead
/// once that QP is dropped (which detached it).
#[derive(Debug)]
pub(super) struct Joined {
    addr: SocketAddr,
    group: McastGroup,
    qp_num: u32,
    owner: Weak<()>,
}

impl CmId {
    /// Joins the multicast group at `group` (an IPv4 or IPv6 multicast
    /// address; the port is ignored) with `qp` (`rdma_join_multicast`),
    /// waits up to `timeout` for MULTICAST_JOIN and attaches `qp` to the
    /// group it names ([`Qp::attach_mcast`]). Returns where to send to the
    /// group, as a [`UdPeer`] (an address handle in `qp`'s PD, QPN
    /// [`MULTICAST_QPN`](crate::qp::MULTICAST_QPN), the group's Q_Key), and the event (its
    /// [`ud`](CmEvent::ud) holds the raw [`UdParam`]).
    ///
    /// `qp` is this id's QP ([`create_ud_qp`](CmId::create_ud_qp)), or one
    /// on its device and port receiving with the group's Q_Key
    /// ([`UDP_QKEY`]); post its receives before joining, so the first
    /// datagram finds one. An id joins one group at a time (a second join
    /// waits for nothing while the first does) and any number in turn.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an address that is not multicast
    /// (`what` = `"multicast address"`), a group this id joined already, an
    /// RC id, an id not bound to a device, or a QP of another device or port;
    /// [`Error::CmEvent`] with MULTICAST_ERROR when the join failed;
    /// [`Error::Timeout`] after `timeout`; `rdma_join_multicast`'s or
    /// [`Qp::attach_mcast`]'s error otherwise. After any error the id is not
    /// a member (the join is left again).
    #[doc(alias = "rdma_join_multicast")]
    pub fn join_multicast<S: QpState>(
        &self,
        qp: &Qp<Ud, S>,
        group: SocketAddr,
        timeout: Duration,
    ) -> Result<(UdPeer, CmEvent)> {
        let _own = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            self.start_join_locked(qp, group)?;
            BlockingWaitGuard::mark(&self.inner)
        };
        let ev = self.inner.expect(Awaited::MCAST_JOINED, timeout);
        self.finish_join(qp, group, ev)
    }

    /// Leaves the group at `group` (`rdma_leave_multicast`) after detaching
    /// `qp`, the QP this id joined it with, from it ([`Qp::detach_mcast`]):
    /// datagrams to the group stop reaching `qp`. A `qp` already detached by
    /// hand is not detached again; the id still leaves. When the QP that
    /// joined has been dropped (its drop detached it), any UD QP leaves in
    /// its place, and is not detached. Does not wait: librdmacm returns once
    /// the kernel dropped the group's pending events.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a group this id did not join
    /// (`"multicast group"`), or, while the QP that joined lives, a `qp`
    /// other than it, which the join did not attach (the id stays a member
    /// then, and the other QP's attachments are untouched, also where it
    /// has the same number); `rdma_leave_multicast`'s error otherwise.
    #[doc(alias = "rdma_leave_multicast")]
    pub fn leave_multicast<S: QpState>(&self, qp: &Qp<Ud, S>, group: SocketAddr) -> Result<()> {
        let _g = self.inner.lock();
        self.inner.refuse_if_waiting()?;
        let addr = group_addr(group);
        let mut joined = self.inner.groups.lock().unwrap_or_else(|p| p.into_inner());
        let Some(i) = joined.iter().position(|j| j.addr == addr) else {
            return Err(Error::InvalidArgument {
                what: "multicast group",
                reason: format!(
                    "this rdma_cm id did not join {}: join it with join_multicast first",
                    addr.ip()
                ),
            });
        };
        let j = &joined[i];
        let same = Weak::ptr_eq(&j.owner, &qp.mcast_owner());
        if !same && j.owner.strong_count() > 0 {
            return Err(Error::InvalidArgument {
                what: "multicast group",
                reason: format!(
                    "QP {:#x} is not attached by this id's join of {} (QP {:#x} joined it): \
                     leave with the QP that joined",
                    qp.qp_num(),
                    addr.ip(),
                    j.qp_num
                ),
            });
        }
        if same && qp.mcast_groups().contains(&j.group) {
            qp.detach_mcast(j.group.gid, j.group.lid)?;
        }
        joined.swap_remove(i);
        leave_locked(self.inner.id(), addr)
    }

    /// The multicast groups this id joined and did not leave, by address.
    pub fn multicast_groups(&self) -> Vec<(SocketAddr, McastGroup)> {
        let joined = self.inner.groups.lock().unwrap_or_else(|p| p.into_inner());
        joined.iter().map(|j| (j.addr, j.group)).collect()
    }

    /// [`start_join_locked`](CmId::start_join_locked) taking the lock, for
    /// the async layer.
    #[cfg(feature = "tokio")]
    pub(crate) fn start_join<S: QpState>(&self, qp: &Qp<Ud, S>, group: SocketAddr) -> Result<()> {
        let _g = self.inner.lock();
        self.inner.refuse_if_waiting()?;
        self.start_join_locked(qp, group)
    }

    /// Checks a join and calls `rdma_join_multicast` (MULTICAST_JOIN or
    /// MULTICAST_ERROR follows). Call with the lock held.
    pub(crate) fn start_join_locked<S: QpState>(
        &self,
        qp: &Qp<Ud, S>,
        group: SocketAddr,
    ) -> Result<()> {
        if !group.ip().is_multicast() {
            return Err(Error::InvalidArgument {
                what: "multicast address",
                reason: format!(
                    "{} is not a multicast address: an IPv4 group is in 224.0.0.0/4 \
                     (e.g. 239.1.1.1), an IPv6 one in ff00::/8",
                    group.ip()
                ),
            });
        }
        let id = self.inner.id();
        check_ud_qp(id, qp)?;
        let addr = group_addr(group);
        let joined = self.inner.groups.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(j) = joined.iter().find(|j| j.addr == addr) {
            let gone = if j.owner.strong_count() == 0 {
                " (with a QP since dropped: leave_multicast with any UD QP first)"
            } else {
                ""
            };
            return Err(Error::InvalidArgument {
                what: "multicast group",
                reason: format!("this rdma_cm id joined {} already{gone}", addr.ip()),
            });
        }
        let mut raw = RawAddr::new(addr);
        // SAFETY: valid id under its lock (caller); raw is a full sockaddr of
        // its family, copied by the call; no user context (NULL).
        if unsafe { ffi::rdma_join_multicast(id, raw.as_ptr(), std::ptr::null_mut()) } != 0 {
            let source = last_errno();
            let hint = (source.raw_os_error() == Some(libc::EINVAL)).then(|| {
                "the id must be bound to an RDMA device first: resolve the group's address \
                 from a local one (resolve_addr(Some(local), group, ..)) or bind to a device's \
                 address"
                    .to_owned()
            });
            return Err(Error::Verb {
                verb: "rdma_join_multicast",
                source,
                hint,
            });
        }
        Ok(())
    }

    /// Takes the outcome of a join's wait: on MULTICAST_JOIN attaches `qp`
    /// and builds the group's address handle; on any failure leaves the
    /// group again.
    pub(crate) fn finish_join<S: QpState>(
        &self,
        qp: &Qp<Ud, S>,
        group: SocketAddr,
        ev: Result<CmEvent>,
    ) -> Result<(UdPeer, CmEvent)> {
        let addr = group_addr(group);
        let joined = ev.and_then(|ev| {
            let Some(p) = ev.ud else {
                return Err(Error::InvalidArgument {
                    what: "rdma_cm event",
                    reason: "MULTICAST_JOIN without its UD parameters".into(),
                });
            };
            let gid = p.av.grh.map_or(crate::device::Gid::ZERO, |g| g.dgid);
            let group = McastGroup {
                gid,
                lid: p.av.dlid,
            };
            let ah = AddressHandle::new(qp.pd(), p.av)?;
            qp.attach_mcast(group.gid, group.lid)?;
            let peer = UdPeer {
                ah,
                qpn: p.qp_num,
                qkey: p.qkey,
            };
            Ok((peer, ev, group))
        });
        let _g = self.inner.lock();
        match joined {
            Ok((peer, ev, group)) => {
                let mut list = self.inner.groups.lock().unwrap_or_else(|p| p.into_inner());
                list.push(Joined {
                    addr,
                    group,
                    qp_num: qp.qp_num(),
                    owner: qp.mcast_owner(),
                });
                Ok((peer, ev))
            }
            Err(e) => {
                // Not a member after an error; a failing leave changes nothing.
                let _ = leave_locked(self.inner.id(), addr);
                Err(e)
            }
        }
    }
}

/// The group's address as librdmacm compares it on leave (port 0).
fn group_addr(group: SocketAddr) -> SocketAddr {
    SocketAddr::new(group.ip(), 0)
}

/// `rdma_leave_multicast`. Call with the id's lock held: every event read
/// is acknowledged under it, so librdmacm's wait for the group's reported
/// events to be acknowledged returns at once.
fn leave_locked(id: *mut ffi::rdma_cm_id, addr: SocketAddr) -> Result<()> {
    let mut raw = RawAddr::new(addr);
    // SAFETY: valid id under its lock (caller); raw is a full sockaddr.
    if unsafe { ffi::rdma_leave_multicast(id, raw.as_ptr()) } != 0 {
        return Err(Error::verb("rdma_leave_multicast", last_errno()));
    }
    Ok(())
}

//! Multicast groups of a UD QP (`ibv_attach_mcast`, `ibv_detach_mcast`).
//!
//! A UD QP attached to a group receives every datagram sent to the group's
//! GID (and, on InfiniBand, its multicast LID) with the remote QPN
//! [`MULTICAST_QPN`] and the QP's Q_Key. The QP owns its memberships: it
//! records each group it was attached to, and detaching is the QP's own call
//! ([`Qp::detach_mcast`]) or its drop, which detaches every group left before
//! `ibv_destroy_qp`. The kernel refuses to destroy a QP with a group still
//! attached (EBUSY, `docs/soundness.md`), so a membership that could outlive
//! its QP's handle (a guard that was forgotten) would leak the QP; a list the
//! QP keeps cannot.
//!
//! On RoCE the attach programs the QP and the interface's multicast MAC
//! filter only: the IP-level membership (IGMP, which switches and the local
//! loopback of the group's datagrams go by) is what
//! [`CmId::join_multicast`](crate::cm::CmId::join_multicast) adds. Use
//! rdma_cm there, or join the group on the interface yourself (a UDP socket's
//! `join_multicast_v4`).

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use super::state::{QpState, Ud};
use super::*;
use crate::device::{Gid, LinkLayer};
use crate::error::Error;

/// The remote QP number of a datagram sent to a multicast group (`0xFFFFFF`):
/// every QP attached to the group's GID receives it.
pub const MULTICAST_QPN: u32 = 0xFF_FFFF;

/// A multicast group a UD QP is attached to: its GID and, on InfiniBand,
/// its multicast LID (0 on RoCE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct McastGroup {
    /// The group's GID (`ff..` or, on RoCE v2, an IPv4-mapped multicast
    /// address `::ffff:224.0.0.0/100`).
    pub gid: Gid,
    /// The group's multicast LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
}

/// The groups a QP is attached to (see the module docs), and, made on first
/// use, a token that lives as long as the QP: an rdma_cm join keeps it weakly
/// to tell the QP that joined from a later one with the same number.
#[derive(Default)]
pub(super) struct Memberships(Mutex<Vec<McastGroup>>, OnceLock<Arc<()>>);

impl Memberships {
    fn lock(&self) -> MutexGuard<'_, Vec<McastGroup>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl QpCore {
    /// Detaches every group the QP is still attached to, before it is
    /// destroyed: the kernel refuses to destroy an attached QP. A failed
    /// detach is ignored (Drop never panics); the destroy then fails and the
    /// QP is leaked as any QP whose destroy failed.
    pub(super) fn detach_all_mcast(&mut self) {
        let groups = std::mem::take(&mut *self.ext.mcast.lock());
        for g in groups {
            let gid = g.gid.to_ffi();
            // SAFETY: raw is a live QP owned by this core; gid lives across the call.
            unsafe { ffi::ibv_detach_mcast(self.raw.as_ptr(), &gid, g.lid) };
        }
    }
}

impl<S: QpState> Qp<Ud, S> {
    /// Attaches this QP to the multicast group `gid` / `lid`
    /// (`ibv_attach_mcast`): from now on it receives the group's datagrams,
    /// until [`detach_mcast`](Qp::detach_mcast) or the QP's drop (which
    /// detaches it). `lid` is the group's multicast LID on InfiniBand
    /// (0xC000..=0xFFFE), 0 on RoCE. On RoCE the attach programs the QP and
    /// the interface's multicast MAC filter only: the IP-level membership
    /// (IGMP, which switches and the local loopback of the group's datagrams
    /// go by) is what [`CmId::join_multicast`](crate::cm::CmId::join_multicast)
    /// adds; without rdma_cm, join the group on the interface yourself (a UDP
    /// socket's `join_multicast_v4`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a GID that is not a multicast one
    /// (`what` = `"multicast GID"`), a LID outside the multicast range on
    /// an InfiniBand port (`"multicast LID"`), or a group this QP is
    /// already attached to (`"multicast group"`); `ibv_attach_mcast`'s error
    /// otherwise (ENOMEM: the device's `max_mcast_grp` or
    /// `max_mcast_qp_attach` is reached).
    #[doc(alias = "ibv_attach_mcast")]
    pub fn attach_mcast(&self, gid: Gid, lid: u16) -> Result<()> {
        self.check_group(gid, lid)?;
        let group = McastGroup { gid, lid };
        let mut list = self.core.ext.mcast.lock();
        if list.contains(&group) {
            return Err(Error::InvalidArgument {
                what: "multicast group",
                reason: format!(
                    "this QP is already attached to {gid} (LID {lid:#x}); the kernel would \
                     report success and keep one attachment: detach it once, or attach once"
                ),
            });
        }
        let raw = gid.to_ffi();
        // SAFETY: valid QP; raw lives across the call, which only reads it.
        verb!(rc: unsafe { ffi::ibv_attach_mcast(self.as_raw(), &raw, lid) })?;
        list.push(group);
        Ok(())
    }

    /// Detaches this QP from a group it was attached to
    /// (`ibv_detach_mcast`); datagrams to the group stop reaching it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (`"multicast group"`) for a group this QP
    /// is not attached to; `ibv_detach_mcast`'s error otherwise (the QP
    /// then stays attached, and its drop tries again).
    #[doc(alias = "ibv_detach_mcast")]
    pub fn detach_mcast(&self, gid: Gid, lid: u16) -> Result<()> {
        let group = McastGroup { gid, lid };
        let mut list = self.core.ext.mcast.lock();
        let Some(i) = list.iter().position(|g| *g == group) else {
            return Err(Error::InvalidArgument {
                what: "multicast group",
                reason: format!(
                    "this QP is not attached to {gid} (LID {lid:#x}); it is attached to {} \
                     group(s): see Qp::mcast_groups",
                    list.len()
                ),
            });
        };
        let raw = gid.to_ffi();
        // SAFETY: valid QP; raw lives across the call, which only reads it.
        verb!(rc: unsafe { ffi::ibv_detach_mcast(self.as_raw(), &raw, lid) })?;
        list.swap_remove(i);
        Ok(())
    }

    /// The groups this QP is attached to, in no particular order.
    pub fn mcast_groups(&self) -> Vec<McastGroup> {
        self.core.ext.mcast.lock().clone()
    }

    /// This QP's identity for the rdma_cm joins made with it: dead once the
    /// QP is dropped, and never the same as another QP's.
    pub(crate) fn mcast_owner(&self) -> Weak<()> {
        Arc::downgrade(self.core.ext.mcast.1.get_or_init(|| Arc::new(())))
    }

    /// Refuses a GID or LID the kernel would answer with a bare EINVAL.
    fn check_group(&self, gid: Gid, lid: u16) -> Result<()> {
        if !gid.is_multicast() {
            return Err(Error::InvalidArgument {
                what: "multicast GID",
                reason: format!(
                    "{gid} is not a multicast GID: use an IPv6 multicast one (ff..), or on \
                     RoCE v2 an IPv4-mapped multicast address (::ffff:224.0.0.0 to \
                     ::ffff:239.255.255.255)"
                ),
            });
        }
        let port = self.core.pd.context().query_port(self.core.port)?;
        if port.link_layer != LinkLayer::Ethernet && !(0xC000..0xFFFF).contains(&lid) {
            return Err(Error::InvalidArgument {
                what: "multicast LID",
                reason: format!(
                    "{lid:#x} is not a multicast LID (0xc000..=0xfffe on InfiniBand): take the \
                     group's MLID from the subnet manager (rdma_cm's MULTICAST_JOIN event)"
                ),
            });
        }
        Ok(())
    }
}

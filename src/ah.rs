//! `AddressHandle`: where a UD datagram goes, and the GRH it arrives with.
//!
//! A UD send names its destination per work request: an address handle
//! (`ibv_ah`, the path: port, GID or LID, hop limit, traffic class, SL), the
//! remote QP number and the Q_Key ([`UdSendWr`](crate::qp::UdSendWr)).
//! [`AddressHandle::new`] builds one from an [`AddressVector`];
//! [`AddressHandle::from_completion`] builds the one that answers a received
//! datagram (`ibv_init_ah_from_wc`), from its completion and its GRH bytes.
//!
//! # The GRH of a UD receive
//! Every UD receive starts with [`GRH_LEN`] (40) bytes the NIC writes before
//! the payload: the Global Route Header (IPv6-like: the sender's and
//! receiver's GIDs) when the completion has `IBV_WC_GRH` set, else
//! undefined. On RoCE v2 over IPv4 the last 20 of them hold the packet's
//! IPv4 header instead. [`grh_source_gid`] reads the sender's GID from either
//! form, as rdma-core does.

use std::fmt;
use std::mem::MaybeUninit;
use std::net::Ipv4Addr;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::cq::Completion;
use crate::device::{Gid, LinkLayer};
use crate::error::{Error, Result, errno, last_errno};
use crate::ffi;
use crate::pd::Pd;
use crate::qp::AddressVector;
use crate::sys::call::verb;

/// Bytes the NIC writes before the payload of every UD receive.
pub const GRH_LEN: usize = 40;

/// An address handle (`ibv_ah`). Cheap to clone (one `Arc`); keeps its
/// [`Pd`] alive, and a UD QP keeps a clone of the handle of every send it
/// posted until that send completed, so dropping the last user clone right
/// after posting is fine.
#[doc(alias = "ibv_ah")]
#[derive(Clone)]
pub struct AddressHandle {
    pub(crate) inner: Arc<AhInner>,
}

pub(crate) struct AhInner {
    raw: NonNull<ffi::ibv_ah>,
    av: AddressVector,
    pd: Pd,
}

// SAFETY: an ibv_ah is immutable after creation; libibverbs lets any thread
// pass it to ibv_post_send (the provider only reads the address vector) and
// destroy it once (Drop, when the last clone is gone: by then no QP of this
// crate holds it in a posted request, see qp::ud).
unsafe impl Send for AhInner {}
// SAFETY: &AddressHandle reaches nothing mutable (the raw pointer, a copy of
// the address vector, the Pd which is Sync).
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: raw came from ibv_create_ah; the last clone is gone, so no
        // posted work request names it. Errors are ignored: Drop never panics.
        unsafe { ffi::ibv_destroy_ah(self.raw.as_ptr()) };
    }
}

impl AddressHandle {
    /// Creates an address handle in `pd` (`ibv_create_ah`), e.g. from
    /// [`AddressVector::global`] (a GID and the local GID index to send
    /// from) or [`AddressVector::local`] (an InfiniBand LID).
    ///
    /// # Errors
    /// Checked before the kernel sees it (which would only say EINVAL):
    /// a port that does not exist ([`Error::InvalidArgument`] `port`), a
    /// local GID index with no GID (`gid index`, naming the valid ones), and
    /// on RoCE an address without a GRH or towards the all-zero GID
    /// (`address vector`).
    #[doc(alias = "ibv_create_ah")]
    pub fn new(pd: &Pd, av: AddressVector) -> Result<AddressHandle> {
        let ctx = pd.context();
        let port = ctx.query_port(av.port)?;
        if let Some(g) = &av.grh {
            ctx.query_gid(av.port, g.sgid_index)?;
        }
        if port.link_layer == LinkLayer::Ethernet {
            let reason = match &av.grh {
                None => "RoCE (an Ethernet port) needs a GRH: use AddressVector::global",
                Some(g) if g.dgid.is_zero() => "RoCE needs the peer's GID, not the all-zero one",
                Some(_) => "",
            };
            if !reason.is_empty() {
                return Err(Error::InvalidArgument {
                    what: "address vector",
                    reason: reason.into(),
                });
            }
        }
        Self::create(pd, av)
    }

    fn create(pd: &Pd, av: AddressVector) -> Result<AddressHandle> {
        if let Some(e) = av.check_widths() {
            return Err(e);
        }
        let mut attr = av.to_ffi();
        // SAFETY: valid PD; attr is a fully initialised ibv_ah_attr the call only reads.
        let raw = verb!(ptr: unsafe { ffi::ibv_create_ah(pd.as_raw(), &mut attr) })?;
        Ok(AddressHandle {
            inner: Arc::new(AhInner {
                raw,
                av,
                pd: pd.clone(),
            }),
        })
    }

    /// The handle that answers a received UD datagram (`ibv_init_ah_from_wc`
    /// then `ibv_create_ah`): towards its sender, from local `port`. `grh`
    /// is the received GRH ([`UdMessage::grh`](crate::qp::UdMessage), at
    /// least [`GRH_LEN`] bytes; only the first 40 are read). The path comes
    /// from the received headers: on soft-RoCE the hop limit came out 64 (the
    /// received IPv4 TTL), where [`AddressVector::global`] uses 1.
    ///
    /// # Errors
    /// `completion` must be a successful receive ([`Error::InvalidArgument`]
    /// otherwise), `grh` at least 40 bytes; on RoCE the completion must carry
    /// a GRH, and the GID it was sent to must be one of this port's
    /// (`ibv_init_ah_from_wc` looks the sending GID index up by it). Together
    /// the two calls are what `ibv_create_ah_from_wc` does.
    #[doc(alias("ibv_init_ah_from_wc", "ibv_create_ah_from_wc"))]
    pub fn from_completion(
        pd: &Pd,
        port: u8,
        completion: &Completion,
        grh: &[u8],
    ) -> Result<AddressHandle> {
        if !completion.status.is_success()
            || !matches!(
                completion.opcode,
                crate::cq::WcOpcode::Recv | crate::cq::WcOpcode::RecvRdmaWithImm
            )
        {
            return Err(Error::InvalidArgument {
                what: "completion",
                reason: format!(
                    "an address handle is built from a successful receive, not a {} with {}",
                    completion.opcode, completion.status
                ),
            });
        }
        let Some(grh) = grh.get(..GRH_LEN) else {
            return Err(Error::InvalidArgument {
                what: "GRH",
                reason: format!("{} bytes, a GRH has {GRH_LEN}", grh.len()),
            });
        };
        let mut wc = ffi::ibv_wc {
            status: ffi::IBV_WC_SUCCESS,
            opcode: completion.opcode.as_raw(),
            byte_len: completion.byte_len,
            qp_num: completion.qp_num,
            src_qp: completion.src_qp,
            wc_flags: completion.wc_flags,
            slid: completion.slid(),
            sl: completion.sl(),
            dlid_path_bits: completion.dlid_path_bits(),
            ..Default::default()
        };
        // An aligned copy: the C struct has 4-byte fields, `grh` may sit anywhere.
        let mut hdr = MaybeUninit::<ffi::ibv_grh>::uninit();
        // SAFETY: `grh` has GRH_LEN == size_of::<ibv_grh>() bytes; the
        // destination is a local of that size; every byte pattern is valid.
        let mut hdr = unsafe {
            std::ptr::copy_nonoverlapping(grh.as_ptr(), hdr.as_mut_ptr().cast::<u8>(), GRH_LEN);
            hdr.assume_init()
        };
        let mut attr = MaybeUninit::<ffi::ibv_ah_attr>::zeroed();
        // A negative return reports errno: none left from before.
        crate::sys::call::clear_errno();
        // SAFETY: valid context; wc and hdr are initialised locals the call
        // reads; attr is written by it (zeroed first).
        let rc = unsafe {
            ffi::ibv_init_ah_from_wc(
                pd.context().as_raw(),
                port,
                &mut wc,
                &mut hdr,
                attr.as_mut_ptr(),
            )
        };
        if rc != 0 {
            let source = if rc < 0 { last_errno() } else { errno(rc) };
            // Checked on failure only (a query per handle would cost a
            // system call): a port that does not exist says so.
            pd.context().query_port(port)?;
            return Err(Error::Verb {
                verb: "ibv_init_ah_from_wc",
                source,
                hint: Some(
                    "the datagram's GRH must name one of this port's GIDs as its destination \
                     (on RoCE every UD receive has one)"
                        .into(),
                ),
            });
        }
        // SAFETY: zeroed, then filled by the call; plain C struct.
        let av = AddressVector::from_ffi(&unsafe { attr.assume_init() });
        Self::create(pd, av)
    }

    /// The address vector it was created from.
    pub fn attr(&self) -> AddressVector {
        self.inner.av
    }

    /// The PD it belongs to.
    pub fn pd(&self) -> &Pd {
        &self.inner.pd
    }

    /// The raw `ibv_ah`, valid while this handle (or a clone) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_ah {
        self.inner.raw.as_ptr()
    }
}

impl fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressHandle")
            .field("av", &self.inner.av)
            .finish()
    }
}

/// The sender's GID from the 40 GRH bytes of a UD receive whose completion
/// has `IBV_WC_GRH`, read as rdma-core's `ibv_init_ah_from_wc` reads them:
/// an IPv6-style GRH (version 6: the source GID at bytes 8..24), or on
/// RoCE v2 over IPv4 an IPv4 header in bytes 20..40 (its source address,
/// as the IPv4-mapped GID `::ffff:a.b.c.d`). `None` when the bytes are
/// neither (or fewer than 40).
pub fn grh_source_gid(grh: &[u8]) -> Option<Gid> {
    let grh: &[u8; GRH_LEN] = grh.get(..GRH_LEN)?.try_into().ok()?;
    let ip4 = &grh[20..40];
    let ip4_ok = ip4[0] == 0x45 && ipv4_checksum_ok(ip4);
    if grh[0] >> 4 == 6 && !ip4_ok {
        let mut g = [0; 16];
        g.copy_from_slice(&grh[8..24]);
        return Some(Gid(g));
    }
    if ip4[0] >> 4 == 4 {
        let src = Ipv4Addr::new(ip4[12], ip4[13], ip4[14], ip4[15]);
        return Some(Gid(src.to_ipv6_mapped().octets()));
    }
    None
}

/// The IPv4 header checksum of a 20-byte header holds (rdma-core trusts the
/// IPv4 reading of a GRH buffer only then).
fn ipv4_checksum_ok(h: &[u8]) -> bool {
    ones_complement_sum(h) == 0xffff
}

/// The 16-bit ones' complement sum of `h`'s big-endian words (RFC 1071).
fn ones_complement_sum(h: &[u8]) -> u16 {
    let mut sum: u32 = h
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4_header(src: [u8; 4], dst: [u8; 4]) -> [u8; 20] {
        let mut h = [
            0x45, 0, 0, 60, 0, 0, 0x40, 0, 64, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        h[12..16].copy_from_slice(&src);
        h[16..20].copy_from_slice(&dst);
        let checksum = !ones_complement_sum(&h);
        h[10..12].copy_from_slice(&checksum.to_be_bytes());
        h
    }

    #[test]
    fn reads_the_source_gid_of_both_grh_forms() {
        let mut v4 = [0u8; GRH_LEN];
        v4[20..].copy_from_slice(&ipv4_header([10, 99, 0, 1], [10, 99, 0, 2]));
        assert_eq!(
            grh_source_gid(&v4),
            Some("::ffff:10.99.0.1".parse().unwrap())
        );
        let mut v6 = [0u8; GRH_LEN];
        v6[0] = 0x60;
        let sgid: Gid = "fe80::1".parse().unwrap();
        v6[8..24].copy_from_slice(&sgid.raw());
        assert_eq!(grh_source_gid(&v6), Some(sgid));
        assert_eq!(grh_source_gid(&[0u8; GRH_LEN]), None);
        assert_eq!(grh_source_gid(&v6[..39]), None);
        // With a bad checksum the bytes are read as an IPv6 GRH.
        v4[30] ^= 1;
        v4[0] = 0x60;
        let mut expect = [0u8; 16];
        expect.copy_from_slice(&v4[8..24]);
        assert_eq!(grh_source_gid(&v4), Some(Gid(expect)));
    }
}

//! Address vectors: where a QP's (or an address handle's) packets go.

use crate::device::Gid;
use crate::error::Error;
use crate::ffi;
use crate::qp::check_bits;

/// Where packets go (`ibv_ah_attr`).
#[doc(alias = "ibv_ah_attr")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// Destination LID (InfiniBand; 0 on RoCE).
    pub dlid: u16,
    /// Service level (4 bits).
    pub sl: u8,
    /// Source path bits (7 bits).
    pub src_path_bits: u8,
    /// Local port.
    pub port: u8,
    /// Global routing header: `Some` on RoCE (always) and routed InfiniBand.
    pub grh: Option<Grh>,
}

/// Global route (`ibv_global_route`).
#[doc(alias = "ibv_global_route")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grh {
    /// Destination GID.
    pub dgid: Gid,
    /// Index of the local GID to send from.
    pub sgid_index: u8,
    /// Hop limit (1 like `ibv_rc_pingpong`; raise it for routed RoCE v2).
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
}

impl Grh {
    /// Towards `dgid` from the local GID at `sgid_index`: hop limit 1,
    /// traffic class and flow label 0.
    pub(crate) fn towards(dgid: Gid, sgid_index: u8) -> Grh {
        Grh {
            dgid,
            sgid_index,
            hop_limit: 1,
            traffic_class: 0,
            flow_label: 0,
        }
    }
}

impl AddressVector {
    /// Towards `dgid` (RoCE, or routed InfiniBand) from the local GID at
    /// `sgid_index` of `port`: hop limit 1 (like the rdma-core examples),
    /// traffic class, flow label and SL 0.
    pub fn global(port: u8, dgid: Gid, sgid_index: u8) -> AddressVector {
        AddressVector {
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            port,
            grh: Some(Grh::towards(dgid, sgid_index)),
        }
    }

    /// A field wider than its wire field, refused (some providers truncate
    /// it silently instead).
    pub(crate) fn check_widths(&self) -> Option<Error> {
        check_bits("SL", self.sl.into(), 4)
            .or_else(|| check_bits("source path bits", self.src_path_bits.into(), 7))
            .or_else(|| {
                let g = self.grh.as_ref()?;
                check_bits("flow label", g.flow_label, 20)
            })
    }

    /// Towards `dlid` within an InfiniBand subnet (no GRH; RoCE refuses this).
    pub fn local(port: u8, dlid: u16) -> AddressVector {
        AddressVector {
            dlid,
            sl: 0,
            src_path_bits: 0,
            port,
            grh: None,
        }
    }

    /// Service level.
    pub fn sl(mut self, sl: u8) -> AddressVector {
        self.sl = sl;
        self
    }

    /// Hop limit of the GRH (no effect without one).
    pub fn hop_limit(mut self, hops: u8) -> AddressVector {
        if let Some(g) = self.grh.as_mut() {
            g.hop_limit = hops;
        }
        self
    }

    /// Traffic class of the GRH (no effect without one).
    pub fn traffic_class(mut self, tclass: u8) -> AddressVector {
        if let Some(g) = self.grh.as_mut() {
            g.traffic_class = tclass;
        }
        self
    }

    pub(crate) fn to_ffi(self) -> ffi::ibv_ah_attr {
        let mut ah = ffi::ibv_ah_attr {
            dlid: self.dlid,
            sl: self.sl,
            src_path_bits: self.src_path_bits,
            port_num: self.port,
            ..Default::default()
        };
        if let Some(g) = self.grh {
            ah.is_global = 1;
            ah.grh = ffi::ibv_global_route {
                dgid: g.dgid.to_ffi(),
                flow_label: g.flow_label,
                sgid_index: g.sgid_index,
                hop_limit: g.hop_limit,
                traffic_class: g.traffic_class,
            };
        }
        ah
    }

    pub(crate) fn from_ffi(ah: &ffi::ibv_ah_attr) -> AddressVector {
        AddressVector {
            dlid: ah.dlid,
            sl: ah.sl,
            src_path_bits: ah.src_path_bits,
            port: ah.port_num,
            grh: (ah.is_global != 0).then(|| Grh {
                dgid: Gid::from_ffi(&ah.grh.dgid),
                sgid_index: ah.grh.sgid_index,
                hop_limit: ah.grh.hop_limit,
                traffic_class: ah.grh.traffic_class,
                flow_label: ah.grh.flow_label,
            }),
        }
    }
}

/// `sl`, `hop_limit` and `traffic_class` for a type whose field `$av` has
/// them (an [`AddressVector`], or a type that holds one).
macro_rules! path_setters {
    ($ty:ident, $av:ident) => {
        impl $ty {
            /// Service level.
            pub fn sl(mut self, sl: u8) -> $ty {
                self.$av = self.$av.sl(sl);
                self
            }

            /// Hop limit of the GRH (no effect without one).
            pub fn hop_limit(mut self, hops: u8) -> $ty {
                self.$av = self.$av.hop_limit(hops);
                self
            }

            /// Traffic class of the GRH (no effect without one).
            pub fn traffic_class(mut self, tclass: u8) -> $ty {
                self.$av = self.$av.traffic_class(tclass);
                self
            }
        }
    };
}
pub(super) use path_setters;

//! [`ConnParam`]: what a connect or an accept asks for.

use super::*;

/// Parameters of a connect or an accept (`rdma_conn_param`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    flow_control: bool,
}

impl Default for ConnParam {
    fn default() -> ConnParam {
        ConnParam::new()
    }
}

impl ConnParam {
    /// No private data; responder resources and initiator depth left to
    /// librdmacm (the device maximum on connect, the smaller of the peer's
    /// request and the device maximum on accept); 6 transport retries (7
    /// means "retry forever" on soft-RoCE, so a dead peer would never be
    /// reported, as with [`RtsAttr::new`](crate::qp::RtsAttr::new)) and 7 RNR
    /// retries (forever: a slow receiver is not an error).
    ///
    /// How soon a dead peer shows: the ACK timeout of a QP connected by
    /// rdma_cm is the kernel CM's (from the path's packet lifetime), not the
    /// ~0.5 s of [`RtsAttr::new`](crate::qp::RtsAttr::new): on soft-RoCE
    /// `RETRY_EXC_ERR` comes about 14 s after the peer dies. A
    /// side that only receives learns nothing until it sends (or the peer's
    /// DISCONNECTED arrives); that is RC, not this crate.
    pub fn new() -> ConnParam {
        ConnParam {
            private_data: Vec::new(),
            responder_resources: ffi::RDMA_MAX_RESP_RES as u8,
            initiator_depth: ffi::RDMA_MAX_INIT_DEPTH as u8,
            retry_count: 6,
            rnr_retry_count: 7,
            flow_control: false,
        }
    }

    /// Data for the peer (at most 56 bytes on connect, 196 on accept, on
    /// InfiniBand/RoCE; the kernel refuses more with EINVAL).
    pub fn private_data(mut self, data: &[u8]) -> ConnParam {
        self.private_data = data.to_vec();
        self
    }

    /// Outstanding RDMA READ/atomic requests this side accepts as target.
    pub fn responder_resources(mut self, n: u8) -> ConnParam {
        self.responder_resources = n;
        self
    }

    /// Outstanding RDMA READ/atomic requests this side issues.
    pub fn initiator_depth(mut self, n: u8) -> ConnParam {
        self.initiator_depth = n;
        self
    }

    /// Transport retries, 0..=7 (active side).
    pub fn retry_count(mut self, n: u8) -> ConnParam {
        self.retry_count = n;
        self
    }

    /// RNR retries, 0..=7 (7: retry forever).
    pub fn rnr_retry_count(mut self, n: u8) -> ConnParam {
        self.rnr_retry_count = n;
        self
    }

    /// Hardware flow control.
    pub fn flow_control(mut self, on: bool) -> ConnParam {
        self.flow_control = on;
        self
    }

    pub(super) fn validate(&self) -> Result<()> {
        if self.private_data.len() > usize::from(u8::MAX) {
            return Err(Error::InvalidArgument {
                what: "private data",
                reason: format!(
                    "{} bytes; rdma_cm carries at most 255 (56 on an InfiniBand/RoCE connect, 196 on an accept)",
                    self.private_data.len()
                ),
            });
        }
        if self.retry_count > 7 || self.rnr_retry_count > 7 {
            return Err(Error::InvalidArgument {
                what: "retry count",
                reason: "retry_count and rnr_retry_count must be 0..=7".into(),
            });
        }
        Ok(())
    }

    /// The C struct; its private_data points into self.
    pub(super) fn to_ffi(&self) -> ffi::rdma_conn_param {
        ffi::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: u8::from(self.flow_control),
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: 0,
        }
    }
}

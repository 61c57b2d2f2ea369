//! Plain values the C API speaks in: GIDs, MTUs, port states, completion
//! statuses and opcodes, rdma_cm event kinds. Each mirrors a C type or enum,
//! converts from and to it without failing, and holds no verbs object.

mod cm_event;
#[cfg(feature = "gdr")]
pub(crate) mod gdr;
mod port;
mod wc;

pub use cm_event::CmEventKind;
pub use port::{AtomicCap, Gid, GidEntry, GidType, LinkLayer, Mtu, NodeType, PortState, Transport};
pub use wc::{WcOpcode, WcStatus};

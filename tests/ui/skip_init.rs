//~ ERROR E0599 no method named `rtr`
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(qp: Qp<Rc, Reset>, attr: rdma_verbs::qp::RtrAttr) {
    let _ = qp.rtr(attr); // RESET -> RTR does not exist
}
fn main() {}

//~ ERROR E0599 no method named `rtr`
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Init, Reset, Rtr, Rts};
use rdma_verbs::{AccessFlags, Cq, InitAttr, Mr, Qp, Rc, RecvWr, SendWr};

fn f(qp: Qp<Rc, Reset>, attr: rdma_verbs::RtrAttr) {
    let _ = qp.rtr(attr); // RESET -> RTR does not exist
}
fn main() {}

//~ ERROR E0277 can be posted only in RTS: this QP is in
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(qp: &mut Qp<Rc, Reset>) {
    let _ = qp.post_send(SendWr::send(1));
}
fn main() {}

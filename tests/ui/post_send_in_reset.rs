//~ ERROR E0277 can be posted only in RTS: this QP is in
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Init, Reset, Rtr, Rts};
use rdma_verbs::{AccessFlags, Cq, InitAttr, Mr, Qp, Rc, RecvWr, SendWr};

fn f(qp: &mut Qp<Rc, Reset>) {
    let _ = qp.post_send(SendWr::send(1));
}
fn main() {}

//~ ERROR E0382 moved value: `qp`
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(qp: Qp<Rc, Reset>) {
    let _init = qp.init(InitAttr::new(1, AccessFlags::empty()));
    let _ = qp.qp_num(); // qp was moved by init()
}
fn main() {}

//~ ERROR E0382 moved value: `mr`
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(qp: &mut Qp<Rc, Rts>, mut mr: Mr) {
    let _ = qp.post_send(SendWr::send(1).sge(mr));
    mr.fill(0).unwrap(); // the NIC owns it until the completion
}
fn main() {}

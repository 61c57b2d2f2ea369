//~ ERROR E0308 SharedMr
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(qp: &mut Qp<Rc, Rts>, mr: Mr) {
    let shared = mr.freeze();
    let _ = qp.post_recv(RecvWr::new(1, shared)); // receives need exclusive buffers
}
fn main() {}

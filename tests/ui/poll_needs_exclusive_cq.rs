//~ ERROR E0596 `*cq` as mutable
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(cq: &Cq) {
    let mut v = Vec::with_capacity(4);
    let _ = cq.poll(&mut v); // one consumer: poll takes &mut Cq
}
fn main() {}

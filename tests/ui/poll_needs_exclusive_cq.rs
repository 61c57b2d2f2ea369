//~ ERROR E0596 `*cq` as mutable
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Init, Reset, Rtr, Rts};
use rdma_verbs::{AccessFlags, Cq, InitAttr, Mr, Qp, Rc, RecvWr, SendWr};

fn f(cq: &Cq) {
    let mut v = Vec::with_capacity(4);
    let _ = cq.poll(&mut v); // one consumer: poll takes &mut Cq
}
fn main() {}

//~ ERROR E0308 Rts
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(qp: Qp<Rc, Init>) -> Qp<Rc, Rts> {
    qp // no way to claim RTS without the transitions
}
fn main() {}

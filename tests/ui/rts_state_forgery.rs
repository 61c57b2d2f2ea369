//~ ERROR E0308 Rts
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Init, Reset, Rtr, Rts};
use rdma_verbs::{AccessFlags, Cq, InitAttr, Mr, Qp, Rc, RecvWr, SendWr};

fn f(qp: Qp<Rc, Init>) -> Qp<Rc, Rts> {
    qp // no way to claim RTS without the transitions
}
fn main() {}

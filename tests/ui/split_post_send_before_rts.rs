//~ ERROR E0277 connect the QP first
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Init, Qp, Rc, SendWr};

// A half keeps its QP's state: no sends before RTS.
fn f(mut qp: Qp<Rc, Init>) {
    let (mut send, _recv) = qp.split();
    let _ = send.post_send(SendWr::send(1));
}
fn main() {}

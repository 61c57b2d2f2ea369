//~ ERROR E0505 cannot move out of `qp` because it is borrowed
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Qp, Rc, Rts, SendWr};

// The QP cannot be dropped (destroyed) while a half still posts on it.
fn f(mut qp: Qp<Rc, Rts>, wr: SendWr<'static>) {
    let (mut send, _recv) = qp.split();
    drop(qp);
    let _ = send.post_send(wr);
}
fn main() {}

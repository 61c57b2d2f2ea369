//~ ERROR E0505 cannot move out of `qp` because it is borrowed
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Qp, Rc, RecvWr, Rts};

// While split, the QP cannot change state: a transition takes it by value.
fn f(mut qp: Qp<Rc, Rts>, wr: RecvWr) {
    let (_send, mut recv) = qp.split();
    let _err = qp.to_error();
    let _ = recv.post_recv(wr);
}
fn main() {}

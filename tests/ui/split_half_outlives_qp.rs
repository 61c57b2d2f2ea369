//~ ERROR E0515 returns a value referencing data owned by the current function
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Qp, Rc, Rts, SendHalf};

// A half borrows its QP: it cannot outlive it.
fn f(mut qp: Qp<Rc, Rts>) -> SendHalf<'static, Rc, Rts> {
    let mut local = qp;
    let (send, _recv) = local.split();
    send
}
fn main() {}

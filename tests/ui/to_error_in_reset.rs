//~ ERROR E0277 cannot be moved to ERR: the kernel refuses RESET -> ERR
#![allow(unused_variables)]
use rdma_verbs::qp::{Qp, Rc, Reset};

fn f(qp: Qp<Rc, Reset>) {
    let _ = qp.to_error();
}
fn main() {}

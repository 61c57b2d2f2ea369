//~ ERROR E0061 this method takes 0 arguments but 1 argument was supplied
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Init, Qp, RtrAttr, Ud};

fn f(qp: Qp<Ud, Init>, attr: RtrAttr) {
    let _ = qp.rtr(attr); // a UD QP has no remote to name at RTR
}
fn main() {}

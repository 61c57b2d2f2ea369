//~ ERROR E0599 no method named `attach_mcast` found
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::device::Gid;
use rdma_verbs::qp::{Qp, Rc, Rts};

fn f(qp: &Qp<Rc, Rts>, group: Gid) {
    // Only UD QPs join multicast groups.
    let _ = qp.attach_mcast(group, 0);
}
fn main() {}

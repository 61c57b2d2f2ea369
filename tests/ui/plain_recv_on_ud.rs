//~ ERROR E0308 expected `UdRecvWr`, found `RecvWr`
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::mr::Mr;
use rdma_verbs::qp::{Qp, RecvWr, Rts, Ud};

fn f(qp: &mut Qp<Ud, Rts>, buf: Mr) {
    // A UD receive needs a separate GRH buffer, so the GRH is never read as data.
    let _ = qp.post_recv(RecvWr::new(1, buf));
}
fn main() {}

//~ ERROR E0308 expected `UdSendWr<'_>`, found `SendWr<'_>`
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::mr::Mr;
use rdma_verbs::qp::{Qp, Rts, SendWr, Ud};

fn f(qp: &mut Qp<Ud, Rts>, src: Mr) {
    // An RC-style SEND names no address handle, remote QPN or Q_Key.
    let _ = qp.post_send(SendWr::send_from(1, src));
}
fn main() {}

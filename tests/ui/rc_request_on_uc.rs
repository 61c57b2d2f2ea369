//~ ERROR E0308 expected `UcSendWr<'_>`, found `SendWr<'_>`
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::mr::{Mr, RemoteMr};
use rdma_verbs::qp::{Qp, Rts, SendWr, Uc};

fn f(qp: &mut Qp<Uc, Rts>, dest: Mr, remote: RemoteMr) {
    // An RC READ request does not sneak onto a UC QP either.
    let _ = qp.post_send(SendWr::read(1, dest, remote, 0));
}
fn main() {}

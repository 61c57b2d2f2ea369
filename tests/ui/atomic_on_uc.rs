//~ ERROR E0599 no function or associated item named `fetch_add` found
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::mr::{Mr, RemoteMr};
use rdma_verbs::qp::{Qp, Rts, Uc, UcSendWr};

fn f(qp: &mut Qp<Uc, Rts>, result: Mr, remote: RemoteMr) {
    let _ = qp.post_send(UcSendWr::fetch_add(1, result, remote, 0, 1)); // UC has no atomics
}
fn main() {}

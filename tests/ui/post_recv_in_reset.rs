//~ ERROR E0277 receives can be posted only from INIT on
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::{Init, Reset, Rtr, Rts};
use rdma_verbs::{AccessFlags, Cq, InitAttr, Mr, Qp, Rc, RecvWr, SendWr};

fn f(qp: &mut Qp<Rc, Reset>, mr: Mr) {
    let _ = qp.post_recv(RecvWr::new(1, mr));
}
fn main() {}

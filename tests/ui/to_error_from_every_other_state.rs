//@ check-pass
#![allow(unused_variables, dead_code)]
use rdma_verbs::qp::{Init, Qp, Rc, Rtr, Rts, Ud};

fn f(a: Qp<Rc, Init>, b: Qp<Rc, Rtr>, c: Qp<Ud, Rts>) {
    let _ = a.to_error();
    let _ = b.to_error();
    if let Ok(err) = c.to_error() {
        // ERR -> ERR is allowed too (it flushes what was posted since).
        let _ = err.to_error();
    }
}
fn main() {}

//~ ERROR E0277 cannot be sent between threads safely
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::qp::{Qp, Rc, Rts};

// The scope reads the QP's counters on its own thread while it polls.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>) -> Result<()> {
    cq.scope(|s| {
        let q = s.attach(qp)?;
        std::thread::scope(|t| {
            t.spawn(move || drop(q));
        });
        Ok(())
    })
}
fn main() {}

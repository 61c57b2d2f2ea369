//~ ERROR E0596 cannot borrow data in dereference of `AdoptedQp
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::qp::{Endpoint, Init, Qp, Rc};

// Swapping the handle inside an adopted QP for another attached QP's would
// let the adopted handle's transitions move the other QP, which its owner
// still names as `Init`.
fn f(cq: &mut Cq, a: Qp<Rc, Init>, b: &mut Qp<Rc, Init>, ep: &Endpoint) -> Result<()> {
    let ((), _a) = cq.scope_adopt(a, |s, mut qa| {
        let mut qb = s.attach(b)?;
        std::mem::swap(&mut *qa, &mut qb);
        let qa = qa.connect(ep, None)?;
        Ok(((), qa))
    })?;
    Ok(())
}
fn main() {}

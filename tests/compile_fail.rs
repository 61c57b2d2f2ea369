//! Misuse of the QP state machine and of posted buffers does not compile.
//! Host-only (no device needed).

#[test]
fn misuse_does_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}

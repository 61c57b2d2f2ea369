//! Output pinned in files under `xtask/testdata/`, so that a refactoring of a renderer
//! shows any byte it changes.

use std::fs;
use std::path::PathBuf;

/// Asserts that `actual` equals the file `xtask/testdata/<name>`. With `XTASK_BLESS=1` in
/// the environment, writes `actual` there instead (to pin a deliberate change).
pub fn assert_pinned(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(name);
    if std::env::var_os("XTASK_BLESS").is_some_and(|v| v == "1") {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, actual).unwrap();
        return;
    }
    let pinned = fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (XTASK_BLESS=1 writes it)", path.display()));
    assert!(
        pinned == actual,
        "output differs from {}:\n{actual}",
        path.display()
    );
}

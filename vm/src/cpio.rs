//! A writer for the "newc" cpio format, the format of a Linux initramfs.
//!
//! Writing the archive ourselves (rather than `find | cpio`) needs no staging tree, can add
//! device nodes without root, and gives the same bytes for the same input. The kernel accepts an
//! uncompressed archive, which also saves the guest a decompression step under emulation.

/// An in-memory newc archive; entries are added in order, parents before children.
pub struct Archive {
    bytes: Vec<u8>,
    next_ino: u32,
}

impl Archive {
    /// An empty archive.
    pub fn new() -> Self {
        Self {
            bytes: Vec::new(),
            next_ino: 1,
        }
    }

    /// Adds a directory (mode 0755).
    pub fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, 0, &[]);
    }

    /// Adds a regular file with the given permission bits.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | (perm & 0o7777), 0, data);
    }

    /// Adds a symbolic link pointing at `target`.
    pub fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, 0o120_777, 0, target.as_bytes());
    }

    /// Adds a character device node (mode 0600).
    pub fn char_dev(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, 0o020_600, (major << 20) | minor, &[]);
    }

    /// Ends the archive and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, &[]);
        self.bytes
    }

    /// Appends one header, name and data; `rdev` packs major << 20 | minor.
    fn entry(&mut self, name: &str, mode: u32, rdev: u32, data: &[u8]) {
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        // The format stores sizes as 32-bit hex; an initramfs member is far below 4 GiB.
        let fields = [
            ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime: fixed, so the same input gives the same archive
            data.len() as u32,
            0, // devmajor
            0, // devminor
            rdev >> 20,
            rdev & 0xf_ffff,
            name.len() as u32 + 1,
            0, // check
        ];
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.bytes.len() & 3 != 0 {
            self.bytes.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout() {
        let mut a = Archive::new();
        a.file("init", 0o755, b"hi");
        let bytes = a.finish();
        assert_eq!(&bytes[..6], b"070701");
        // 110-byte header, "init\0" (5) padded to 116, data 2 padded to 120.
        assert_eq!(&bytes[110..115], b"init\0");
        assert_eq!(&bytes[116..118], b"hi");
        assert_eq!(&bytes[120..126], b"070701");
        assert_eq!(bytes.len() % 4, 0);
    }
}

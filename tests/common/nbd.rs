//! A minimal NBD client speaking the raw protocol (simple replies), for tests that
//! need exact control of what is sent.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub const READ: u16 = 0;
pub const WRITE: u16 = 1;
pub const DISC: u16 = 2;
pub const FLUSH: u16 = 3;
pub const TRIM: u16 = 4;
pub const WRITE_ZEROES: u16 = 6;
pub const FLAG_FUA: u16 = 1;

pub struct Client {
    pub s: UnixStream,
    pub size: u64,
    pub flags: u16,
}

/// A client leaves as a well-behaved one does: NBD_CMD_DISC, then the server's
/// close awaited (3 s at most), so what a test does next (a removal) finds the
/// device no longer open through it, as after a process closed a block device.
impl Drop for Client {
    fn drop(&mut self) {
        let mut b = Vec::with_capacity(28);
        b.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&DISC.to_be_bytes());
        b.extend_from_slice(&[0u8; 20]); // handle, offset, length
        if self.s.write_all(&b).is_err() {
            return;
        }
        let _ = self.s.set_read_timeout(Some(Duration::from_secs(3)));
        let mut sink = [0u8; 4096];
        while matches!(self.s.read(&mut sink), Ok(n) if n > 0) {}
    }
}

fn opt(s: &mut UnixStream, code: u32, data: &[u8]) {
    let mut b = Vec::new();
    b.extend_from_slice(&0x4948_4156_454F_5054u64.to_be_bytes());
    b.extend_from_slice(&code.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).expect("send option");
}

/// Read one option reply: (type, payload).
pub fn opt_reply(s: &mut UnixStream) -> (u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).expect("option reply");
    assert_eq!(
        u64::from_be_bytes(h[0..8].try_into().unwrap()),
        0x0003_e889_0455_65a9
    );
    let typ = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).expect("option payload");
    (typ, p)
}

/// Connect and read the greeting; returns the stream after sending client flags.
pub fn greet(sock: &Path) -> UnixStream {
    let mut s = UnixStream::connect(sock).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).ok();
    let mut g = [0u8; 18];
    s.read_exact(&mut g).expect("greeting");
    assert_eq!(&g[0..8], b"NBDMAGIC");
    assert_eq!(&g[8..16], b"IHAVEOPT");
    s.write_all(&3u32.to_be_bytes()).expect("client flags");
    s
}

impl Client {
    /// Fixed-newstyle handshake with NBD_OPT_GO, simple replies only.
    pub fn connect(sock: &Path, export: &str) -> Client {
        go_on(greet(sock), export).unwrap_or_else(|(_, e)| panic!("NBD_OPT_GO for {export} failed: {e:#x}"))
    }

    pub fn send(&mut self, cmd: u16, flags: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = Vec::with_capacity(28 + payload.len());
        b.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&cmd.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(payload);
        self.s.write_all(&b).expect("send request");
    }

    /// Read a simple reply: (cookie, error). `data_len` bytes follow a successful read.
    pub fn reply(&mut self, data: Option<&mut [u8]>) -> (u64, u32) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).expect("reply header");
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().unwrap()),
            0x6744_6698,
            "simple reply magic"
        );
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        if err == 0 {
            if let Some(d) = data {
                self.s.read_exact(d).expect("read data");
            }
        }
        (cookie, err)
    }

    /// One request, one reply: the error value.
    pub fn call(&mut self, cmd: u16, flags: u16, offset: u64, len: u32, payload: &[u8]) -> u32 {
        self.send(cmd, flags, 7, offset, len, payload);
        let mut buf = vec![0u8; if cmd == READ { len as usize } else { 0 }];
        let (c, e) = self.reply(if cmd == READ { Some(&mut buf) } else { None });
        assert_eq!(c, 7);
        e
    }

    /// A write or flush that tolerates the server going away: `None` when the
    /// connection broke before the reply.
    pub fn try_call(&mut self, cmd: u16, offset: u64, payload: &[u8]) -> Option<u32> {
        let mut b = Vec::with_capacity(28 + payload.len());
        b.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&cmd.to_be_bytes());
        b.extend_from_slice(&7u64.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        b.extend_from_slice(payload);
        self.s.write_all(&b).ok()?;
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).ok()?;
        Some(u32::from_be_bytes(h[4..8].try_into().ok()?))
    }

    pub fn read(&mut self, offset: u64, len: usize) -> Vec<u8> {
        self.send(READ, 0, 9, offset, len as u32, &[]);
        let mut buf = vec![0u8; len];
        let (_, e) = self.reply(Some(&mut buf));
        assert_eq!(e, 0, "read at {offset} failed");
        buf
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        assert_eq!(
            self.call(WRITE, 0, offset, data.len() as u32, data),
            0,
            "write at {offset} failed"
        );
    }
}

/// Send one option request (public form of the handshake helper).
pub fn send_opt(s: &mut UnixStream, code: u32, data: &[u8]) {
    opt(s, code, data);
}

/// NBD_OPT_GO for `export` on a stream already past the greeting. Ok(client) on
/// success, Err(reply type) when the server refused the export (the handshake
/// continues).
pub fn go_on(mut s: UnixStream, export: &str) -> Result<Client, (UnixStream, u32)> {
    let mut d = Vec::new();
    d.extend_from_slice(&(export.len() as u32).to_be_bytes());
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    opt(&mut s, 7, &d);
    let (mut size, mut flags) = (0, 0);
    loop {
        let (typ, p) = opt_reply(&mut s);
        match typ {
            3 if p.len() == 12 && p[0..2] == [0, 0] => {
                size = u64::from_be_bytes(p[2..10].try_into().unwrap());
                flags = u16::from_be_bytes(p[10..12].try_into().unwrap());
            }
            3 => {}
            1 => return Ok(Client { s, size, flags }),
            e => return Err((s, e)),
        }
    }
}

/// Whether the peer closes `s` within `within` (reads and throws away anything
/// it sends first). A connection still open after that returns false.
pub fn closed_within(s: &mut UnixStream, within: Duration) -> bool {
    let t0 = std::time::Instant::now();
    let mut b = [0u8; 4096];
    while t0.elapsed() < within {
        s.set_read_timeout(Some(Duration::from_millis(100))).ok();
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true, // ECONNRESET and the like
        }
    }
    false
}

/// Whether a reply (any byte) is waiting on `c` within `within`; consumes nothing.
pub fn reply_ready(c: &Client, within: Duration) -> bool {
    use std::os::fd::AsRawFd;
    c.s.set_read_timeout(Some(within)).ok();
    let mut b = [0u8; 1];
    // SAFETY: a one-byte receive into a local buffer on our own socket.
    let n = unsafe { libc::recv(c.s.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK) };
    c.s.set_read_timeout(Some(Duration::from_secs(20))).ok();
    n > 0
}

pub const CACHE: u16 = 5;
pub const BLOCK_STATUS: u16 = 7;
pub const FLAG_NO_HOLE: u16 = 2;
pub const FLAG_DF: u16 = 4;
pub const FLAG_REQ_ONE: u16 = 8;
pub const FLAG_FAST_ZERO: u16 = 0x10;
pub const FLAG_PAYLOAD_LEN: u16 = 0x20;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = 0x8001;
pub const REPLY_FLAG_DONE: u16 = 1;

/// One reply as it came off the wire: a simple reply (with a read's data), or one
/// chunk of a structured reply.
#[derive(Clone, PartialEq, Eq)]
pub enum Reply {
    Simple {
        cookie: u64,
        error: u32,
        data: Vec<u8>,
    },
    Chunk {
        cookie: u64,
        flags: u16,
        typ: u16,
        payload: Vec<u8>,
    },
}

/// Payloads shown by length and first bytes: a failed assertion on a 32 MiB read
/// stays readable.
impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |b: &[u8]| format!("{} bytes {:02x?}", b.len(), &b[..b.len().min(16)]);
        match self {
            Reply::Simple { cookie, error, data } => {
                write!(
                    f,
                    "Simple {{ cookie: {cookie:#x}, error: {error}, data: {} }}",
                    show(data)
                )
            }
            Reply::Chunk {
                cookie,
                flags,
                typ,
                payload,
            } => write!(
                f,
                "Chunk {{ cookie: {cookie:#x}, flags: {flags:#x}, type: {typ:#x}, payload: {} }}",
                show(payload)
            ),
        }
    }
}

impl Reply {
    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } | Reply::Chunk { cookie, .. } => *cookie,
        }
    }

    /// The error a reply carries: a simple reply's error field, or an error
    /// chunk's error value (0 for any other chunk).
    pub fn error(&self) -> u32 {
        match self {
            Reply::Simple { error, .. } => *error,
            Reply::Chunk { typ, payload, .. } if typ & 0x8000 != 0 => {
                u32::from_be_bytes(payload[0..4].try_into().expect("error chunk too short"))
            }
            Reply::Chunk { .. } => 0,
        }
    }

    pub fn done(&self) -> bool {
        match self {
            Reply::Simple { .. } => true,
            Reply::Chunk { flags, .. } => flags & REPLY_FLAG_DONE != 0,
        }
    }
}

impl Client {
    /// Read the next reply, simple or structured. A successful simple reply is
    /// followed by `data_len(cookie)` bytes of read data (0 for anything else).
    pub fn next_reply(&mut self, data_len: impl Fn(u64) -> usize) -> Reply {
        let mut m = [0u8; 4];
        self.s.read_exact(&mut m).expect("reply magic");
        match u32::from_be_bytes(m) {
            0x6744_6698 => {
                let mut h = [0u8; 12];
                self.s.read_exact(&mut h).expect("simple reply");
                let error = u32::from_be_bytes(h[0..4].try_into().unwrap());
                let cookie = u64::from_be_bytes(h[4..12].try_into().unwrap());
                let mut data = vec![0u8; if error == 0 { data_len(cookie) } else { 0 }];
                self.s.read_exact(&mut data).expect("read data");
                Reply::Simple { cookie, error, data }
            }
            0x668e_33ef => {
                let mut h = [0u8; 16];
                self.s.read_exact(&mut h).expect("chunk header");
                let flags = u16::from_be_bytes(h[0..2].try_into().unwrap());
                let typ = u16::from_be_bytes(h[2..4].try_into().unwrap());
                let cookie = u64::from_be_bytes(h[4..12].try_into().unwrap());
                let len = u32::from_be_bytes(h[12..16].try_into().unwrap()) as usize;
                assert!(len <= (32 << 20) + 8, "chunk payload of {len} bytes");
                let mut payload = vec![0u8; len];
                self.s.read_exact(&mut payload).expect("chunk payload");
                Reply::Chunk {
                    cookie,
                    flags,
                    typ,
                    payload,
                }
            }
            x => panic!("bad reply magic {x:#x}"),
        }
    }

    /// Every chunk of the structured reply to `cookie`, up to the one marked DONE
    /// (no other request may be in flight).
    pub fn chunks(&mut self, cookie: u64) -> Vec<Reply> {
        let mut out = Vec::new();
        loop {
            let r = self.next_reply(|_| 0);
            assert_eq!(r.cookie(), cookie, "chunk of another request: {r:?}");
            assert!(
                matches!(r, Reply::Chunk { .. }),
                "simple reply in structured mode: {r:?}"
            );
            let done = r.done();
            out.push(r);
            if done {
                return out;
            }
        }
    }
}

/// A handshake with structured replies and, when `contexts` is not empty,
/// SET_META_CONTEXT for them; the contexts the server selected (id, name).
pub fn connect_structured(sock: &Path, export: &str, contexts: &[&str]) -> (Client, Vec<(u32, String)>) {
    let mut s = greet(sock);
    opt(&mut s, 8, &[]);
    let (typ, p) = opt_reply(&mut s);
    assert_eq!((typ, p.len()), (1, 0), "STRUCTURED_REPLY not acknowledged");
    let mut selected = Vec::new();
    if !contexts.is_empty() {
        let mut d = Vec::new();
        d.extend_from_slice(&(export.len() as u32).to_be_bytes());
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&(contexts.len() as u32).to_be_bytes());
        for c in contexts {
            d.extend_from_slice(&(c.len() as u32).to_be_bytes());
            d.extend_from_slice(c.as_bytes());
        }
        opt(&mut s, 10, &d);
        loop {
            let (typ, p) = opt_reply(&mut s);
            match typ {
                4 => selected.push((
                    u32::from_be_bytes(p[0..4].try_into().unwrap()),
                    String::from_utf8(p[4..].to_vec()).expect("context name"),
                )),
                1 => break,
                e => panic!("SET_META_CONTEXT answered {e:#x}"),
            }
        }
    }
    let c = go_on(s, export).unwrap_or_else(|(_, e)| panic!("NBD_OPT_GO for {export} failed: {e:#x}"));
    (c, selected)
}

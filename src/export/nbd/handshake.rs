//! Fixed-newstyle negotiation: the option haggling before transmission.

use super::proto::*;
use crate::mapper::{Device, Registry};
use std::io::{self, Read, Write};
use std::sync::Arc;

/// What the handshake settled.
pub struct Negotiated {
    pub dev: Arc<Device>,
    pub size: u64,
    pub flags: u16,
    pub structured: bool,
    pub base_allocation: bool,
    /// The base of the `qemu:dirty-bitmap:BASE` context, if selected.
    pub dirty_base: Option<String>,
}

/// Which exports a client may see by name: the others are answered as absent.
pub type Visible<'a> = &'a dyn Fn(&str) -> bool;

/// Negotiation state that options build up.
struct State<'a> {
    visible: Visible<'a>,
    no_zeroes: bool,
    fixed: bool,
    structured: bool,
    /// The export (device) of the last SET_META_CONTEXT that selected a context,
    /// and what it selected.
    meta_export: Option<Arc<Device>>,
    meta_allocation: bool,
    meta_dirty: Option<String>,
}

impl State<'_> {
    /// The outcome of entering transmission on `dev`: contexts count only if the
    /// last SET_META_CONTEXT named this same export.
    fn negotiated(&self, dev: Arc<Device>, size: u64, flags: u16) -> Negotiated {
        let same = self.meta_export.as_ref().is_some_and(|m| Arc::ptr_eq(m, &dev));
        Negotiated {
            dev,
            size,
            flags,
            structured: self.structured,
            base_allocation: same && self.meta_allocation,
            dirty_base: self.meta_dirty.clone().filter(|_| same),
        }
    }
}

fn rd_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn rd_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn reply<W: Write>(w: &mut W, opt: u32, typ: u32, data: &[u8]) -> io::Result<()> {
    let mut h = Vec::with_capacity(20 + data.len());
    h.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    h.extend_from_slice(&opt.to_be_bytes());
    h.extend_from_slice(&typ.to_be_bytes());
    h.extend_from_slice(&(data.len() as u32).to_be_bytes());
    h.extend_from_slice(data);
    w.write_all(&h)
}

fn err<W: Write>(w: &mut W, opt: u32, typ: u32, msg: &str) -> io::Result<()> {
    reply(w, opt, typ, msg.as_bytes())
}

fn protocol(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// Transmission flags for a device: what its table's limits allow, as the kernel's
/// queue limits would (TRIM where discards are honoured, FAST_ZERO where zeroing is
/// native; WRITE_ZEROES always, falling back to writing zeroes), less writes for
/// read-only devices. All connections share one set of backing files and flushes
/// reach those files, so CAN_MULTI_CONN holds.
pub fn transmission_flags(dev: &Device, structured: bool) -> u16 {
    let l = dev.limits();
    let mut f = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_CACHE;
    if l.fua {
        f |= TF_SEND_FUA;
    }
    if l.multi_conn {
        f |= TF_CAN_MULTI_CONN;
    }
    if dev.read_only() || l.read_only {
        f |= TF_READ_ONLY;
    } else {
        f |= TF_SEND_WRITE_ZEROES;
        if l.discard {
            f |= TF_SEND_TRIM;
        }
        if l.write_zeroes {
            f |= TF_SEND_FAST_ZERO;
        }
    }
    if structured {
        f |= TF_SEND_DF;
    }
    f
}

/// The device an export name names, among those the client may see; the empty
/// name is the default export when the client may see exactly one device. One it
/// may not see is answered as a device that does not exist.
fn lookup(reg: &Registry, visible: Visible, name: &str) -> Result<Arc<Device>, String> {
    if name.is_empty() {
        let all: Vec<_> = reg.list().into_iter().filter(|d| visible(&d.name())).collect();
        return match all.len() {
            1 => Ok(all[0].clone()),
            0 => Err("no devices exist".into()),
            _ => Err("no default export: name a device".into()),
        };
    }
    let hidden = || crate::mapper::registry::ControlError::NoDevice(name.to_string()).to_string();
    match reg.get(name) {
        Ok(d) if visible(name) => Ok(d),
        Ok(_) => Err(hidden()),
        // `NAME@POINT`: a device's past, for a client that may see the device
        Err(_) => match name.split_once('@') {
            Some((base, _)) if visible(base) => reg.open_view(name).map_err(|e| e.to_string()),
            _ => Err(hidden()),
        },
    }
}

/// What the option haggling ended with.
pub enum Outcome {
    /// NBD_OPT_GO or NBD_OPT_EXPORT_NAME succeeded: transmission starts.
    Go(Negotiated),
    /// The client aborted or disconnected cleanly.
    Closed,
    /// NBD_OPT_STARTTLS was acknowledged: the TLS handshake comes next, then
    /// the options again inside TLS.
    StartTls,
}

/// Where the handshake stands with TLS.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TlsState {
    /// The server has no TLS: STARTTLS is unsupported.
    Off,
    /// Offered, not started: plain options are served.
    Offered,
    /// Required, not started: options other than STARTTLS and ABORT are refused.
    Required,
    /// The options now run inside TLS.
    Active,
}

/// Send the greeting and read the client's flags.
pub fn greet<S: Read + Write>(s: &mut S) -> io::Result<Greeted> {
    let mut g = Vec::with_capacity(18);
    g.extend_from_slice(&NBDMAGIC.to_be_bytes());
    g.extend_from_slice(&IHAVEOPT.to_be_bytes());
    g.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&g)?;
    let mut cf = [0u8; 4];
    s.read_exact(&mut cf)?;
    let cflags = u32::from_be_bytes(cf);
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(protocol("client flags carry unknown bits"));
    }
    Ok(Greeted {
        no_zeroes: cflags & FLAG_C_NO_ZEROES != 0,
        fixed: cflags & FLAG_C_FIXED_NEWSTYLE != 0,
    })
}

/// The client's flags, which hold across STARTTLS.
#[derive(Clone, Copy)]
pub struct Greeted {
    no_zeroes: bool,
    fixed: bool,
}

/// Run the handshake of a server without TLS. Ok(None) when the client aborted
/// or disconnected cleanly.
pub fn negotiate<S: Read + Write>(s: &mut S, reg: &Registry) -> io::Result<Option<Negotiated>> {
    let g = greet(s)?;
    match options(s, reg, g, TlsState::Off, &|_| true)? {
        Outcome::Go(n) => Ok(Some(n)),
        Outcome::Closed | Outcome::StartTls => Ok(None),
    }
}

/// The options, until transmission, the end, or STARTTLS. Nothing negotiated
/// before STARTTLS carries over: this starts afresh inside TLS.
// Long: one arm per option of the NBD protocol (`NBD_OPT_*`), each a few
// lines.
pub fn options<S: Read + Write>(
    s: &mut S,
    reg: &Registry,
    g: Greeted,
    tls: TlsState,
    visible: Visible,
) -> io::Result<Outcome> {
    let mut st = State {
        visible,
        no_zeroes: g.no_zeroes,
        fixed: g.fixed,
        structured: false,
        meta_export: None,
        meta_allocation: false,
        meta_dirty: None,
    };
    for _ in 0..MAX_OPTIONS {
        let mut h = [0u8; 16];
        match s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(Outcome::Closed),
            Err(e) => return Err(e),
        }
        if u64::from_be_bytes(h[0..8].try_into().unwrap_or_default()) != IHAVEOPT {
            return Err(protocol("bad option magic"));
        }
        let opt = rd_u32(&h[8..]);
        let len = rd_u32(&h[12..]);
        if len > MAX_OPTION_LEN {
            return Err(protocol("option data too long"));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;
        if !st.fixed && opt != OPT_EXPORT_NAME {
            err(
                s,
                opt,
                REP_ERR_INVALID,
                "only NBD_OPT_EXPORT_NAME without fixed newstyle",
            )?;
            continue;
        }
        if tls == TlsState::Required && !matches!(opt, OPT_STARTTLS | OPT_ABORT) {
            if opt == OPT_EXPORT_NAME {
                // no way to answer an error but to hang up
                return Err(protocol(
                    "NBD_OPT_EXPORT_NAME before STARTTLS on a server that requires TLS",
                ));
            }
            err(
                s,
                opt,
                REP_ERR_TLS_REQD,
                "this server requires TLS: send NBD_OPT_STARTTLS first",
            )?;
            continue;
        }
        match opt {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data).into_owned();
                // No way to report an error here but to hang up.
                let dev = lookup(reg, visible, &name).map_err(|e| protocol(&e))?;
                let size = dev.size_sectors() * 512;
                let flags = transmission_flags(&dev, st.structured);
                let mut r = Vec::with_capacity(134);
                r.extend_from_slice(&size.to_be_bytes());
                r.extend_from_slice(&flags.to_be_bytes());
                if !st.no_zeroes {
                    r.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&r)?;
                return Ok(Outcome::Go(st.negotiated(dev, size, flags)));
            }
            OPT_ABORT => {
                let _ = reply(s, opt, REP_ACK, &[]);
                return Ok(Outcome::Closed);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    err(s, opt, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                    continue;
                }
                for d in reg.list().into_iter().filter(|d| visible(&d.name())) {
                    let mut p = Vec::new();
                    let name = d.name();
                    p.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    p.extend_from_slice(name.as_bytes());
                    p.extend_from_slice(description(&d).as_bytes());
                    reply(s, opt, REP_SERVER, &p)?;
                }
                reply(s, opt, REP_ACK, &[])?;
            }
            OPT_STARTTLS => match tls {
                TlsState::Off => err(s, opt, REP_ERR_UNSUP, "TLS is not enabled on this server")?,
                TlsState::Active => err(s, opt, REP_ERR_INVALID, "TLS is already negotiated")?,
                _ if !data.is_empty() => err(s, opt, REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data")?,
                _ => {
                    reply(s, opt, REP_ACK, &[])?;
                    return Ok(Outcome::StartTls);
                }
            },
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    err(s, opt, REP_ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data")?;
                } else if st.structured {
                    err(s, opt, REP_ERR_INVALID, "structured replies already negotiated")?;
                } else {
                    st.structured = true;
                    reply(s, opt, REP_ACK, &[])?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => meta_context(s, reg, &mut st, opt, &data)?,
            OPT_INFO | OPT_GO => {
                if let Some(n) = info_go(s, reg, &st, opt, &data)? {
                    return Ok(Outcome::Go(n));
                }
            }
            _ => err(s, opt, REP_ERR_UNSUP, "option not supported")?,
        }
    }
    Err(protocol("too many options"))
}

fn description(d: &Device) -> String {
    let types: Vec<&str> = d
        .live
        .load()
        .as_ref()
        .map(|t| t.entries.iter().map(|e| e.target.type_name()).collect())
        .unwrap_or_default();
    format!("dmkit device {} ({})", d.name(), types.join(","))
}

/// NBD_OPT_INFO / NBD_OPT_GO. Some(..) when GO succeeded (transmission starts).
fn info_go<S: Write>(
    s: &mut S,
    reg: &Registry,
    st: &State,
    opt: u32,
    data: &[u8],
) -> io::Result<Option<Negotiated>> {
    if data.len() < 6 {
        err(s, opt, REP_ERR_INVALID, "option data too short")?;
        return Ok(None);
    }
    let nlen = rd_u32(data) as usize;
    if nlen > data.len() - 6 {
        err(
            s,
            opt,
            REP_ERR_INVALID,
            "export name length runs past the option data",
        )?;
        return Ok(None);
    }
    let name = String::from_utf8_lossy(&data[4..4 + nlen]).into_owned();
    let nreq = rd_u16(&data[4 + nlen..]) as usize;
    if data.len() != 6 + nlen + 2 * nreq {
        err(
            s,
            opt,
            REP_ERR_INVALID,
            "information request count does not match the option length",
        )?;
        return Ok(None);
    }
    let dev = match lookup(reg, st.visible, &name) {
        Ok(d) => d,
        Err(e) => {
            err(s, opt, REP_ERR_UNKNOWN, &e)?;
            return Ok(None);
        }
    };
    let size = dev.size_sectors() * 512;
    let flags = transmission_flags(&dev, st.structured);
    let mut p = Vec::with_capacity(12);
    p.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    p.extend_from_slice(&size.to_be_bytes());
    p.extend_from_slice(&flags.to_be_bytes());
    reply(s, opt, REP_INFO, &p)?;
    let reqs: Vec<u16> = (0..nreq).map(|i| rd_u16(&data[6 + nlen + 2 * i..])).collect();
    for r in reqs {
        let mut p = r.to_be_bytes().to_vec();
        match r {
            INFO_NAME => p.extend_from_slice(dev.name().as_bytes()),
            INFO_DESCRIPTION => p.extend_from_slice(description(&dev).as_bytes()),
            INFO_BLOCK_SIZE => {
                let min = dev.logical_block_size().max(MIN_BLOCK);
                // the stack's io_min where it is a power of two (a thin pool's block)
                let io_min = dev.limits().io_min;
                let pref = if io_min.is_power_of_two() && io_min <= u64::from(MAX_PAYLOAD) {
                    io_min as u32
                } else {
                    PREF_BLOCK
                };
                p.extend_from_slice(&min.to_be_bytes());
                p.extend_from_slice(&pref.max(PREF_BLOCK).max(min).to_be_bytes());
                p.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
            }
            _ => continue,
        }
        reply(s, opt, REP_INFO, &p)?;
    }
    reply(s, opt, REP_ACK, &[])?;
    if opt == OPT_GO {
        return Ok(Some(st.negotiated(dev, size, flags)));
    }
    Ok(None)
}

/// LIST/SET_META_CONTEXT: base:allocation, and qemu:dirty-bitmap:BASE where the
/// export's targets can compare with BASE (a thin device against an older thin of
/// its pool it shares data with). A context that cannot be given is left out of
/// the answer, as the protocol says, and the log says why.
fn meta_context<S: Write>(
    s: &mut S,
    reg: &Registry,
    st: &mut State,
    opt: u32,
    data: &[u8],
) -> io::Result<()> {
    let set = opt == OPT_SET_META_CONTEXT;
    if set {
        st.meta_export = None;
        st.meta_allocation = false;
        st.meta_dirty = None;
        if !st.structured {
            return err(
                s,
                opt,
                REP_ERR_INVALID,
                "structured replies must be negotiated first",
            );
        }
    }
    let bad = |s: &mut S| err(s, opt, REP_ERR_INVALID, "malformed meta context request");
    if data.len() < 8 {
        return bad(s);
    }
    let nlen = rd_u32(data) as usize;
    if nlen > data.len() - 8 {
        return bad(s);
    }
    let name = String::from_utf8_lossy(&data[4..4 + nlen]).into_owned();
    let nq = rd_u32(&data[4 + nlen..]) as usize;
    let mut pos = 8 + nlen;
    let mut queries = Vec::new();
    for _ in 0..nq {
        if pos + 4 > data.len() {
            return bad(s);
        }
        let l = rd_u32(&data[pos..]) as usize;
        pos += 4;
        if l > data.len() - pos {
            return bad(s);
        }
        queries.push(String::from_utf8_lossy(&data[pos..pos + l]).into_owned());
        pos += l;
    }
    if pos != data.len() {
        return bad(s);
    }
    let dev = match lookup(reg, st.visible, &name) {
        Ok(d) => d,
        Err(e) => return err(s, opt, REP_ERR_UNKNOWN, &e),
    };
    let allocation = if set {
        queries.iter().any(|q| q == BASE_ALLOCATION)
    } else {
        queries.is_empty() || queries.iter().any(|q| q == BASE_ALLOCATION || q == "base:")
    };
    if allocation {
        let id = if set { BASE_ALLOCATION_ID } else { 0 };
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(BASE_ALLOCATION.as_bytes());
        reply(s, opt, REP_META_CONTEXT, &p)?;
        if set {
            st.meta_allocation = true;
        }
    }
    let mut dirty = None;
    for q in &queries {
        let Some(base) = q.strip_prefix(DIRTY_BITMAP_PREFIX) else {
            if q != BASE_ALLOCATION && q != "base:" {
                tracing::info!("NBD: export '{name}': unknown meta context '{q}' left out");
            }
            continue;
        };
        if dirty.is_some() {
            tracing::info!("NBD: export '{name}': one dirty-bitmap context at a time; '{q}' left out");
            continue;
        }
        match crate::mapper::device_check_base(&dev, base) {
            Ok(()) => {
                let id = if set { DIRTY_BITMAP_ID } else { 0 };
                let mut p = id.to_be_bytes().to_vec();
                p.extend_from_slice(q.as_bytes());
                reply(s, opt, REP_META_CONTEXT, &p)?;
                dirty = Some(base.to_string());
            }
            Err(why) => tracing::warn!("NBD: export '{name}': meta context '{q}' refused: {why}"),
        }
    }
    if set {
        st.meta_dirty = dirty;
        if st.meta_allocation || st.meta_dirty.is_some() {
            st.meta_export = Some(dev);
        }
    }
    reply(s, opt, REP_ACK, &[])
}

//! Kernel oracle for dm-crypt (one boot of Debian's Linux 6.12 under qemu,
//! tests/oracle/run.sh, with dm-crypt and the crypto modules it uses loaded):
//! images that dmkit's `crypt` wrote read the same plaintext through the
//! kernel's dm-crypt with the same table, images the kernel wrote read the same
//! through dmkit, and both print the same table line.

mod common;
mod oracle;

use common::nbd::Client;
use common::{image, pattern, Daemon, Scratch};
use oracle::{marker, markers, md5, GUEST_HELPERS};
use std::path::Path;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 4 * MIB;

/// What the guest loads for dm-crypt, in dependency order (paths under the
/// 6.12 kernel's modules; cbc, ecb, aes and sha256 are built in).
const MODULES: &str = "lib/crypto/gf128mul.ko crypto/xts.ko crypto/authenc.ko crypto/essiv.ko \
                       crypto/cryptd.ko crypto/crypto_simd.ko arch/x86/crypto/aesni-intel.ko \
                       drivers/md/dm-crypt.ko";

/// (name, table after the device's length with `DEV` for the device, sectors).
struct Case {
    name: &'static str,
    table: String,
    sectors: u64,
}

fn case(name: &'static str, cipher: &str, key_bytes: usize, rest: &str, offset: u64) -> Case {
    let key: String = (0..key_bytes)
        .map(|i| format!("{:02x}", (i * 37 + usize::from(name.as_bytes()[0]) * 11) as u8))
        .collect();
    let (iv_offset, opts) = rest.split_once(' ').unwrap_or((rest, ""));
    let opts = if opts.is_empty() {
        String::new()
    } else {
        format!(" {opts}")
    };
    Case {
        name,
        table: format!("{cipher} {key} {iv_offset} DEV {offset}{opts}"),
        sectors: SIZE / 512 - offset,
    }
}

fn table(c: &Case, dev: &str) -> String {
    format!("0 {} crypt {}", c.sectors, c.table.replace("DEV", dev))
}

/// The table line without its device field (the kernel prints major:minor).
fn without_device(line: &str) -> Vec<String> {
    let mut f: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    if f.len() > 6 {
        f.remove(6);
    }
    f
}

#[test]
fn dmkit_and_the_kernels_dm_crypt_read_each_others_images() {
    let s = Scratch::new("crypt-oracle");
    // dmkit writes these, the kernel reads them
    let ours = [
        case("a", "aes-xts-plain64", 64, "40", 8),
        case(
            "b",
            "capi:cbc(aes)-essiv:sha256",
            32,
            "64 2 sector_size:4096 iv_large_sectors",
            0,
        ),
    ];
    // the kernel writes these, dmkit reads them
    let theirs = [
        case("c", "aes-xts-plain64", 64, "24", 0),
        case(
            "d",
            "aes-cbc-essiv:sha256",
            16,
            "40 2 allow_discards sector_size:4096",
            0,
        ),
        case("e", "aes-xts-plain64be", 32, "16 1 iv_large_sectors", 0),
        case("f", "capi:xts(aes)-plain", 48, "7", 0),
    ];
    let mut imgs = Vec::new();
    let mut want = Vec::new();
    {
        let d = Daemon::start("crypt-oracle-w");
        for (i, c) in ours.iter().enumerate() {
            let img = image(&s, &format!("{}.img", c.name), SIZE, None);
            d.create(c.name, &table(c, &img.display().to_string()));
            let mut cl = Client::connect(&d.sock(), c.name);
            let data = pattern(40 + i as u64, (c.sectors * 512) as usize);
            for (j, chunk) in data.chunks(256 << 10).enumerate() {
                cl.write((j * (256 << 10)) as u64, chunk);
            }
            assert!(cl.read(0, data.len()) == data, "{}: dmkit reads back", c.name);
            want.push(md5(&data));
            imgs.push(img);
        }
    }
    for c in &theirs {
        imgs.push(image(&s, &format!("{}.img", c.name), SIZE, Some(9)));
    }

    let mut script = String::from(GUEST_HELPERS);
    let devs = ["vda", "vdb", "vdc", "vdd", "vde", "vdf"];
    for (c, dev) in ours.iter().chain(&theirs).zip(devs) {
        let n = c.name;
        script += &format!("mk k{n} \"{}\"\n", table(c, &format!("/dev/{dev}")));
        script += &format!("echo \"ORACLE {n}-table $(dmsetup table --showkeys k{n})\"\n");
    }
    for c in &ours {
        let n = c.name;
        script += &format!("echo \"ORACLE {n}-md5 $(sum /dev/mapper/k{n})\"\n");
    }
    for c in &theirs {
        let n = c.name;
        script += &format!(
            "dd if=/dev/urandom of=/dev/mapper/k{n} bs=65536 count={} 2>/dev/null\nsync\n\
             echo \"ORACLE {n}-md5 $(sum /dev/mapper/k{n})\"\n",
            c.sectors * 512 / 65536
        );
    }
    for c in ours.iter().chain(&theirs) {
        script += &format!("dmsetup remove k{}\n", c.name);
    }
    script += "echo \"ORACLE done yes\"\n";
    let disks: Vec<&Path> = imgs.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &disks,
        &[("ORACLE_MODULES", MODULES), ("DMKIT_ORACLE_KERNEL", "6.12")],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    for (c, w) in ours.iter().zip(&want) {
        assert_eq!(
            marker(&m, &format!("{}-md5", c.name)),
            w,
            "{}: the kernel reads dmkit's image as the plaintext dmkit wrote ({})",
            c.name,
            c.table
        );
    }
    let d = Daemon::start("crypt-oracle-r");
    for (c, img) in ours.iter().chain(&theirs).zip(&imgs) {
        d.create(c.name, &table(c, &img.display().to_string()));
        let kernel = marker(&m, &format!("{}-table", c.name));
        let mine = d.ok(&["table", c.name]);
        assert_eq!(
            without_device(&mine),
            without_device(kernel),
            "{}: the table lines differ (device aside)",
            c.name
        );
    }
    for c in &theirs {
        let mut cl = Client::connect(&d.sock(), c.name);
        let got = cl.read(0, (c.sectors * 512) as usize);
        assert_eq!(
            md5(&got),
            marker(&m, &format!("{}-md5", c.name)),
            "{}: dmkit reads the kernel's image as the plaintext the kernel wrote ({})",
            c.name,
            c.table
        );
    }
}

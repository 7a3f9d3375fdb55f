//! thin_restore-made metadata opens in dmkit, can be modified, and stays
//! valid; dmkit's restore/dump round-trip through the real tools.

use crate::thin_util;
use dmkit::thin::ir::Header;
use dmkit::thin::xml::{self, Piece, XmlDevice, XmlMetadata};
use thin_util::*;

/// `dmkit thin ARGS...`'s exit status.
fn dmkit_thin(args: &[&std::ffi::OsStr]) -> Option<i32> {
    std::process::Command::new(env!("CARGO_BIN_EXE_dmkit"))
        .arg("thin")
        .args(args)
        .status()
        .expect("run dmkit")
        .code()
}

/// Random XML: several devices, some data blocks mapped by two devices.
fn generated_xml(seed: u64) -> XmlMetadata {
    let mut rng = Rng::new(seed);
    let nr_data = 300_000u64;
    let mut devices = Vec::new();
    let mut next_data = 0u64;
    for dev in [0u64, 3, 7, 100, 4096] {
        let mut mappings = Vec::new();
        let mut v = 0u64;
        let n = 2000 + rng.below(30_000);
        for _ in 0..n {
            v += 1 + rng.below(3);
            let b = if rng.below(10) == 0 && next_data > 0 {
                rng.below(next_data)
            } else {
                next_data += 1;
                next_data - 1
            };
            mappings.push((v, b, rng.below(4) as u32));
        }
        devices.push(XmlDevice {
            dev_id: dev,
            mapped_blocks: mappings.len() as u64,
            transaction: rng.below(5),
            creation_time: rng.below(3) as u32,
            snap_time: 3,
            pieces: XmlDevice::runs(&mappings).into_iter().map(Piece::Run).collect(),
        });
    }
    XmlMetadata {
        superblock: Header {
            uuid: String::new(),
            time: 4,
            transaction: 9,
            flags: 0,
            version: 2,
            data_block_size: 256,
            nr_data_blocks: nr_data,
        },
        defs: Vec::new(),
        devices,
    }
}

fn model_of(md: &XmlMetadata) -> Model {
    model_of_xml(&xml::write(md))
}

#[test]
fn thin_restore_output_opens_and_modifies_cleanly() {
    let s = Scratch::new("restore");
    let gen = generated_xml(7);
    let text = xml::write(&gen);
    let xml_path = s.path("in.xml");
    std::fs::write(&xml_path, &text).unwrap();
    let p = s.file("meta", 16384);
    thin_restore(&xml_path, &p);
    let mut model = model_of(&gen);
    let mut md = open_file(&p);
    assert_eq!(model_of_api(&mut md), model);
    assert_eq!(md.transaction_id(), 9);
    assert_eq!(md.time(), 4);
    // modifications: inserts, overwrites, removes, snapshots, deletes
    let mut rng = Rng::new(99);
    md.create_snap(5000, 3).unwrap();
    model.insert(5000, model[&3].clone());
    let t = md.time();
    for dev in [0u64, 3, 5000] {
        for _ in 0..3000 {
            let vb = rng.below(40_000);
            if rng.below(3) == 0 {
                let was = md.remove(dev, vb).unwrap();
                assert_eq!(was, model.get_mut(&dev).unwrap().remove(&vb).is_some());
            } else {
                let b = md.alloc_data_block().unwrap();
                md.insert(dev, vb, b).unwrap();
                model.get_mut(&dev).unwrap().insert(vb, (b, t));
            }
        }
    }
    md.delete(7).unwrap();
    model.remove(&7);
    md.create_thin(12).unwrap();
    model.insert(12, Default::default());
    md.set_transaction_id(9, 10).unwrap();
    assert!(md.set_transaction_id(9, 11).is_err());
    md.commit().unwrap();
    drop(md);
    assert_thin_check_clean(&p);
    let theirs = thin_dump(&p, false);
    assert_eq!(model_of_xml(&theirs), model);
    assert_eq!(theirs, our_dump(&p, false));
    assert!(theirs.starts_with("<superblock uuid=\"\" time=\"5\" transaction=\"10\""));
}

#[test]
fn dmkit_restore_round_trips_through_thin_dump() {
    let s = Scratch::new("ourrestore");
    let gen = generated_xml(11);
    let text = xml::write(&gen);
    let xml_path = s.path("in.xml");
    std::fs::write(&xml_path, &text).unwrap();
    let p = s.file("meta", 16384);
    let code = dmkit_thin(&[
        "restore".as_ref(),
        "-i".as_ref(),
        xml_path.as_ref(),
        "-o".as_ref(),
        p.as_ref(),
    ]);
    assert_eq!(code, Some(0));
    assert_thin_check_clean(&p);
    assert_eq!(our_dump(&p, false), text);
    {
        let theirs = thin_dump(&p, false);
        assert_eq!(theirs, text);
    }
    // data ref counts: blocks mapped twice have count 2
    let mut md = open_file(&p);
    let mut counts = std::collections::HashMap::<u64, u32>::new();
    for d in &gen.devices {
        for (_, b, _) in gen.blocks(d) {
            *counts.entry(b).or_default() += 1;
        }
    }
    for (&b, &c) in counts.iter().take(5000) {
        assert_eq!(md.data_block_ref_count(b), c, "data block {b}");
    }
    assert_eq!(
        md.nr_data_blocks() - md.nr_free_data_blocks(),
        counts.len() as u64
    );
    assert_eq!(model_of_api(&mut md), model_of(&gen));
}

#[test]
fn dmkit_check_agrees_with_thin_check() {
    let s = Scratch::new("check");
    let gen = generated_xml(3);
    let xml_path = s.path("in.xml");
    std::fs::write(&xml_path, xml::write(&gen)).unwrap();
    let p = s.file("meta", 16384);
    thin_restore(&xml_path, &p);
    let check = |p: &std::path::Path| dmkit_thin(&["check".as_ref(), "-q".as_ref(), p.as_ref()]);
    assert_eq!(check(&p), Some(0));
    // a leaked block: bump a free block's count through the API without a reference
    let mut md = open_file(&p);
    let b = md.alloc_data_block().unwrap();
    md.commit().unwrap();
    drop(md);
    // a leak fails the check (exit 64, as 1.x), and so it does in the reference
    assert_eq!(check(&p), Some(64), "leaked data block {b} not reported");
    assert!(!thin_check(&p, &[]).0);
    // any single-byte corruption of a live node is caught by both
    let img = std::fs::read(&p).unwrap();
    let mut bad = img.clone();
    // the metadata space map's index block, wherever the superblock says it is
    let idx = u64::from_le_bytes(img[192 + 16..192 + 24].try_into().unwrap()) as usize;
    bad[idx * 4096 + 100] ^= 0x10;
    std::fs::write(&p, &bad).unwrap();
    assert_eq!(check(&p), Some(64));
    {
        let (ok, _, _) = thin_check(&p, &[]);
        assert!(!ok);
    }
}

#[test]
fn restore_writes_the_superblock_as_thin_restore_does() {
    let s = Scratch::new("uuid");
    let mut gen = generated_xml(5);
    gen.superblock.uuid = "a-uuid-longer-than-16-bytes".into();
    let xml_path = s.path("in.xml");
    std::fs::write(&xml_path, xml::write(&gen)).unwrap();
    let theirs = s.file("theirs", 16384);
    thin_restore(&xml_path, &theirs);
    let ours = s.file("ours", 16384);
    let rc = dmkit_thin(&[
        "restore".as_ref(),
        "-i".as_ref(),
        xml_path.as_ref(),
        "-o".as_ref(),
        ours.as_ref(),
    ]);
    assert_eq!(rc, Some(0));
    let (a, b) = (std::fs::read(&theirs).unwrap(), std::fs::read(&ours).unwrap());
    // 1.x stores no uuid; magic, version, time and transaction id; block sizes
    assert_eq!(&b[16..32], &[0u8; 16]);
    assert_eq!(&a[16..56], &b[16..56], "uuid .. transaction id");
    assert_eq!(&a[336..344], &b[336..344], "block sizes");
    let ours_dump = our_dump(&ours, false);
    assert_eq!(thin_dump(&theirs, false), ours_dump);
    assert_eq!(thin_dump(&ours, false), ours_dump);
}

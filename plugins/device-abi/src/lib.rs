//! device abi

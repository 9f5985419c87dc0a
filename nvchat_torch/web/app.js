// The page's client: microphone -> /v1/realtime (OpenAI Realtime GA, pcm16 at 24 kHz both ways)
// -> gap-free playback, transcripts, tool calls and the server's real-time factor.
'use strict';
const RATE = 24000, CHUNK = 1920;  // 80 ms at 24 kHz: one model frame per append
const $ = (id) => document.getElementById(id);
let ws = null, ctx = null, mic = null, player = null, deltas = 0, line = null, userLine = null;
// A phrase the TTS speaks during a tool call (nvchat.hold_speech): the transcript delta that follows it
// is that phrase, shown marked.
let holdSpeech = null;
const HOLD = {ack: 'acknowledging a tool call', on_hold: 'while a tool runs', timeout: 'the tool timed out'};

function toBase64(int16) {
  const bytes = new Uint8Array(int16.buffer);
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function fromBase64(b64) {
  const bin = atob(b64), n = bin.length >> 1, out = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    let v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 32768;
  }
  return out;
}

function pcm16(floats) {
  const out = new Int16Array(floats.length);
  for (let i = 0; i < floats.length; i++) out[i] = Math.round(Math.max(-1, Math.min(1, floats[i])) * 32767);
  return out;
}

function send(event) { if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event)); }

function setStatus(text) { $('status').textContent = text; document.body.dataset.status = text; }

// Whose turn it is, from the server's events (NVIDIA's turn-taking as GA server VAD events).
const TURNS = {user: 'you are speaking', thinking: 'the model takes the turn', assistant: 'the model is speaking',
               listening: 'listening', interrupted: 'interrupted: listening', idle: 'idle'};
function setTurn(turn) { $('turn').textContent = TURNS[turn]; $('turn').dataset.turn = turn; }

// Messages to the player's worklet that it answers with its queue depth in samples, in order.
const depthReplies = [];
function askPlayer(message) {
  return new Promise((resolve) => { depthReplies.push(resolve); player.port.postMessage(message); });
}
function queued() { return askPlayer('depth'); }
const bargeIns = [];  // per drop: samples queued before it and right after it (the page's test reads them)

function dropPlayback() {
  // at once, in this event's handler: what the model said before the user cut in is not played
  const before = askPlayer('clear'), after = queued();
  const turn = $('turn').dataset.turn;  // 'assistant' or 'interrupted': the user cut in over the model
  Promise.all([before, after]).then(([b, a]) => bargeIns.push({before: b, after: a, turn}));
}

function addLine(pane, cls) {
  const div = document.createElement('div');
  div.className = 'turn ' + (cls || '');
  $(pane).appendChild(div);
  return div;
}

function showToolCall(event) {
  const box = $('tools');
  if (box.querySelector('i')) box.textContent = '';
  const div = document.createElement('div');
  div.className = 'call';
  div.innerHTML = '<code></code> <input size="30" placeholder=\'result, e.g. {"temperature": 21}\'> <button>Send result</button>';
  div.querySelector('code').textContent = `${event.name}(${event.arguments})  [${event.call_id}]`;
  div.querySelector('button').onclick = () => {
    const output = div.querySelector('input').value || '""';
    send({type: 'conversation.item.create', item: {type: 'function_call_output', call_id: event.call_id, output}});
    div.querySelector('button').disabled = true;
  };
  box.appendChild(div);
}

function onEvent(event) {
  switch (event.type) {
    case 'session.created': setStatus('connected'); break;
    case 'session.updated': setStatus('streaming'); if ($('turn').dataset.turn === 'idle') setTurn('listening'); break;
    case 'input_audio_buffer.speech_started':
      // the user speaks (or talks over the model): queued playback is dropped
      if (player) dropPlayback();
      setTurn('user');
      break;
    case 'input_audio_buffer.speech_stopped': setTurn('thinking'); break;
    case 'conversation.item.input_audio_transcription.delta':
      if (!userLine) userLine = addLine('user');
      userLine.textContent += event.delta;
      break;
    case 'conversation.item.input_audio_transcription.completed': userLine = null; break;
    case 'response.created': line = addLine('assistant'); setTurn('assistant'); break;
    case 'nvchat.hold_speech': holdSpeech = event; break;
    case 'response.output_audio_transcript.delta':
      if (!line) line = addLine('assistant');
      if (holdSpeech && holdSpeech.response_id === event.response_id) {
        const span = document.createElement('span');
        span.className = 'hold';
        span.dataset.reason = holdSpeech.reason;
        span.title = HOLD[holdSpeech.reason] || 'while a tool runs';
        span.textContent = event.delta;
        line.append(span);
        holdSpeech = null;
      } else {
        line.append(event.delta);
      }
      break;
    case 'response.output_audio.delta': {
      const samples = fromBase64(event.delta);
      player.port.postMessage(samples, [samples.buffer]);
      $('audio-deltas').textContent = ++deltas;
      break;
    }
    case 'response.done':
      line = null;
      if ($('turn').dataset.turn === 'assistant') {
        setTurn(event.response.status === 'cancelled' ? 'interrupted' : 'listening');
      }
      break;
    case 'response.function_call_arguments.done': showToolCall(event); break;
    case 'nvchat.stats':
      $('rtf').textContent = event.realtime_factor.toFixed(3);
      $('frames').textContent = event.frames;
      $('backlog').textContent = event.backlog_ms;
      break;
    case 'nvchat.notice': $('notices').textContent += `${event.code}: ${event.message}\n`; break;
    case 'error': $('errors').textContent += `${event.error.code}: ${event.error.message}\n`; break;
  }
}

async function start() {
  $('start').disabled = true;
  setStatus('starting');
  try {
    ctx = new AudioContext({sampleRate: RATE});
    await ctx.audioWorklet.addModule('/web/worklet.js');
    mic = await navigator.mediaDevices.getUserMedia(
      {audio: {channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false}});
    const source = ctx.createMediaStreamSource(mic);
    const capture = new AudioWorkletNode(ctx, 'capture', {processorOptions: {chunk: CHUNK}});
    player = new AudioWorkletNode(ctx, 'player');
    player.port.onmessage = (e) => { if (depthReplies.length) depthReplies.shift()(e.data.depth); };
    source.connect(capture);
    capture.connect(ctx.destination);  // outputs silence; connected so the graph pulls it
    player.connect(ctx.destination);
    await ctx.resume();
    const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/v1/realtime`;
    const protocols = ['realtime'];
    if ($('apikey').value) protocols.push('openai-insecure-api-key.' + $('apikey').value);
    ws = new WebSocket(url, protocols);
    ws.onopen = () => {
      const nvchat = {stats: true};
      if ($('selfplay').checked) nvchat.turn_taking = {self_play_suppression: true};
      const session = {type: 'realtime', output_modalities: ['audio'], nvchat,
                       audio: {input: {format: {type: 'audio/pcm', rate: RATE}},
                               output: {format: {type: 'audio/pcm', rate: RATE}}}};
      if ($('instructions').value) session.instructions = $('instructions').value;
      if ($('tools-json').value.trim()) {
        try { session.tools = JSON.parse($('tools-json').value); } catch (err) {
          $('errors').textContent += `the tools are not JSON: ${err}\n`;
        }
      }
      send({type: 'session.update', session});
      capture.port.onmessage = (e) => send({type: 'input_audio_buffer.append', audio: toBase64(pcm16(e.data))});
      $('stop').disabled = false;
    };
    ws.onmessage = (e) => onEvent(JSON.parse(e.data));
    ws.onclose = (e) => { setStatus(`closed (${e.code})`); stop(); };
  } catch (err) {
    $('errors').textContent += `could not start: ${err}\n`;
    setStatus('failed');
    stop();
  }
}

function stop() {
  if (ws && ws.readyState === WebSocket.OPEN) { ws.close(1000); setStatus('stopped'); }
  if (mic) mic.getTracks().forEach((t) => t.stop());
  if (ctx) ctx.close();
  ws = ctx = mic = player = null;
  setTurn('idle');
  $('stop').disabled = true;
  $('start').disabled = false;
}

$('start').onclick = start;
$('stop').onclick = stop;
if (new URLSearchParams(location.search).has('autostart')) start();
window.nvchat = {onEvent, queued, bargeIns};  // for tests and the console
